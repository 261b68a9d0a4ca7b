"""Who may use the admin routes, and what a runtime LoRA load may read.

Runtime adapter loading (``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``,
vLLM's routes) makes every shard pod of a model read a folder the caller names, so it is
off unless the router starts with ``--allow-runtime-lora`` (vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``); when API keys are on, only a key marked
``admin: true`` may call it; and ``lora_path`` must be an absolute path under
``--lora-root``. The shard server checks the path again against its own ``--lora-root``
after resolving symbolic links (``grpc_service.LoadAdapter``), since only it sees its
file system.
"""

from __future__ import annotations

import posixpath
from typing import Optional

from starlette.requests import Request

from kubeshard_router.auth import ApiKey, ApiKeys
from kubeshard_router.config import RouterConfig
from kubeshard_router.errors import Forbidden, ValidationFailed


class AdminPolicy:
    def __init__(self, config: RouterConfig, api_keys: Optional[ApiKeys]) -> None:
        self.allow_runtime_lora = config.allow_runtime_lora
        self.lora_root = posixpath.normpath(config.lora_root) if config.lora_root else None
        self.api_keys = api_keys

    def authorize_runtime_lora(self, request: Request) -> Optional[ApiKey]:
        """The caller's key when it may load and unload adapters; 403 (or 401) otherwise."""
        if not self.allow_runtime_lora:
            raise Forbidden("runtime LoRA adapter loading is off: start the router with --allow-runtime-lora "
                            "and --lora-root DIR (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)",
                            code="runtime_lora_disabled")
        if self.api_keys is None:
            return None
        key = self.api_keys.authenticate(request.headers.get("authorization"))
        if not key.admin:
            raise Forbidden(f"the API key `{key.name}` is not an admin key: only keys marked `admin: true` in "
                            "the key file may load or unload LoRA adapters", code="admin_key_required")
        return key

    def lora_path(self, path: str) -> str:
        """``path`` normalized, when it is absolute and under ``--lora-root``; else a 422."""
        if not path:
            raise ValidationFailed("`lora_path` is required", param="lora_path")
        if not posixpath.isabs(path):
            raise ValidationFailed(f"`lora_path` must be an absolute path under {self.lora_root}, got {path!r}",
                                   param="lora_path")
        normal = posixpath.normpath(path)
        root = self.lora_root or "/"
        if posixpath.commonpath([normal, root]) != root:
            raise ValidationFailed(f"`lora_path` {path!r} is outside the router's --lora-root {root}",
                                   param="lora_path")
        return normal
