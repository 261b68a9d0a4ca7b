"""Real processes for integration tests: ``kubeshard serve-shard`` leaders, the
``kubeshard-router`` CLI, and the ``kubeshard serve`` launcher, on loopback ports."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from tests.support.redis_server import free_port

SHARD_READY = re.compile(r"kubeshard shard ready: model (?P<model>\S+) on (?P<host>[^:\s]+):(?P<port>\d+)")
ROUTER_READY = re.compile(r"^kubeshard ready on http://(?P<host>[^:\s]+):(?P<port>\d+)$")


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen
    lines: list[str] = field(default_factory=list)
    match: dict = field(default_factory=dict)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    @property
    def address(self) -> str:
        return f"{self.match['host']}:{self.match['port']}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> Optional[int]:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the whole session: no orphans
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        self.stop(signal.SIGKILL)


def start(name: str, cmd: list[str], ready: re.Pattern, timeout: float = 300,
          env: Optional[dict] = None) -> Proc:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                            start_new_session=True)
    p = Proc(name, proc)
    found = threading.Event()

    def pump() -> None:
        for line in proc.stdout:
            p.lines.append(line)
            m = ready.search(line.strip()) if not found.is_set() else None
            if m:
                p.match.update(m.groupdict())
                found.set()
        found.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not found.wait(0.1):
        if time.monotonic() > deadline:
            break
    if not p.match:
        p.kill()
        raise RuntimeError(f"{name} did not become ready:\n{p.output[-4000:]}")
    return p


def start_shard(model_dir, *flags: str, threads: int = 1) -> Proc:
    cmd = [sys.executable, "-m", "kubeshard_shard.cli", "serve-shard", "--model", str(model_dir),
           "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--num-threads", str(threads),
           "--kv-cache-memory", "64MiB", *flags]
    return start("serve-shard", cmd, SHARD_READY)


def start_router(*flags: str) -> Proc:
    cmd = [sys.executable, "-m", "kubeshard_router.cli", "--host", "127.0.0.1", "--port", "0", *flags]
    return start("kubeshard-router", cmd, ROUTER_READY, timeout=120)


def start_serve(model_dir, *flags: str) -> Proc:
    cmd = [sys.executable, "-m", "kubeshard_shard.cli", "serve", "--model", str(model_dir),
           "--host", "127.0.0.1", "--port", str(free_port()), *flags]
    return start("kubeshard serve", cmd, ROUTER_READY)
