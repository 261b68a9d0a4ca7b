"""A fixed list of replica leaders per model (what ``kubeshard serve`` starts)."""

from __future__ import annotations

from kubeshard_router.backends.registry import Registry


class StaticSource:
    def __init__(self, backends: dict[str, tuple[str, ...]]) -> None:
        self.backends = dict(backends)

    async def start(self, registry: Registry) -> None:
        for model, addresses in self.backends.items():
            registry.declare(model, addresses)

    async def stop(self) -> None:
        return None

    def static_models(self) -> list[str]:
        return list(self.backends)
