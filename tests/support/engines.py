"""Peer engines for tests: whether each one's environment is built, and starting them.

The environments are built once by ``hack/engines.sh NAME`` (``make engines``) and cached
under $KUBESHARD_CACHE; a cold build is long (llama.cpp compiles from source), so
``make test`` runs an engine's tests when its environment exists and otherwise skips
them with the reason and the command that builds it (pytest's -ra summary lists them).
With ``KUBESHARD_REQUIRE_ENGINES=1`` (``make test-engines``) a missing engine fails.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path
from typing import Optional

import pytest

from kubeshard_shard.paths import cache_root
from kubeshard_shard.runtimes.onnx_model import BUILDER_VERSION
from kubeshard_shard.runtimes.peers import PEERS, Launch
from tests.support.ports import free_port
from tests.support.processes import Proc, start

INFO_READY = re.compile(r"kubeshard shard ready: model (?P<model>\S+) \((?P<runtime>\w+)\) on "
                        r"(?P<host>[^:\s]+):(?P<port>\d+)")
ENGINE_READY = {
    "llamacpp": re.compile(r"Uvicorn running on http://(?P<host>[^:\s]+):(?P<port>\d+)"),
    "vllm": re.compile(r"(?P<ready>Application startup complete)"),
}


def missing(name: str) -> Optional[str]:
    """Why engine ``name`` cannot run here, or None."""
    if name == "onnx":
        builder = cache_root() / "engines" / f"onnx-{BUILDER_VERSION}" / "bin" / "python"
        exports = list((cache_root() / "models" / "onnx").glob("*/genai_config.json"))
        if builder.is_file() or exports or os.environ.get("KUBESHARD_ONNX_BUILDER"):
            return None
        return (f"the ONNX Runtime GenAI model builder is not built ({builder}): run `hack/engines.sh onnx` "
                "(or `make engines`)")
    python = PEERS[name].python()
    if python.is_file():
        return None
    return f"the {name} engine is not built ({python}): run `hack/engines.sh {name}` (or `make engines`)"


def require(name: str) -> None:
    """Skips (or, with KUBESHARD_REQUIRE_ENGINES=1, fails) a test whose engine is not built."""
    why = missing(name)
    if why is None:
        return
    if os.environ.get("KUBESHARD_REQUIRE_ENGINES") == "1":
        pytest.fail(f"KUBESHARD_REQUIRE_ENGINES=1 and {why}")
    pytest.skip(why)


def start_peer(name: str, model: Path, model_id: str, max_total_tokens: int, threads: int = 2,
               timeout: float = 900, extra_args: list[str] | None = None) -> tuple[Proc, str]:
    """The engine's own server on a free port: (process, its base URL); ``extra_args``
    go after the engine's usual command line."""
    runtime = PEERS[name]
    port = free_port()
    launch = Launch(model, model_id, "127.0.0.1", port, max_total_tokens, threads)
    proc = start(f"{name} engine", runtime.command(launch) + list(extra_args or ()), ENGINE_READY[name],
                 timeout=timeout,
                 env=runtime.env(launch), wait=False)
    if not proc.wait_ready(timeout):
        stop_engine(proc)
        raise RuntimeError(f"the {name} engine did not become ready within {timeout:.0f}s:\n{proc.output[-4000:]}")
    return proc, f"http://127.0.0.1:{port}"


def stop_engine(proc: Proc) -> None:
    """Stops an engine and every process it started (vLLM's engine core and workers
    outlive a killed API server): SIGTERM, then SIGKILL to its whole session."""
    proc.stop(timeout=30)
    try:
        os.killpg(proc.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def start_engine_info(name: str, model: Path, model_id: str, engine_url: str, max_total_tokens: int) -> Proc:
    port = engine_url.rsplit(":", 1)[1]
    cmd = [sys.executable, "-m", "kubeshard_shard.cli", "engine-info", "--runtime", name, "--model", str(model),
           "--model-id", model_id, "--engine-url", engine_url, "--openai-port", port, "--host", "127.0.0.1",
           "--port", "0", "--max-total-tokens", str(max_total_tokens)]
    return start("engine-info", cmd, INFO_READY, timeout=120)
