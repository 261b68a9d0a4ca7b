"""Real processes for tests: start a command, collect its output, wait for a ready line."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen
    lines: list[str] = field(default_factory=list)
    match: dict = field(default_factory=dict)
    ready: threading.Event = field(default_factory=threading.Event)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    @property
    def address(self) -> str:
        return f"{self.match['host']}:{self.match['port']}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def wait_ready(self, timeout: float) -> bool:
        """True once the ready line was seen; False if the process ended or time ran out."""
        self.ready.wait(timeout)
        return bool(self.match)

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
        """Ends the whole session at once: a SIGKILL to the command alone left its children
        (a `kubeshard serve`'s shard servers) running as orphans."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # the session is gone already
        self.proc.wait()


def start(name: str, cmd: list[str], ready: re.Pattern, timeout: float = 300, env: Optional[dict] = None,
          wait: bool = True, cwd: Optional[str] = None) -> Proc:
    """Starts ``cmd`` in its own session; with ``wait``, returns once a line matches
    ``ready`` (its named groups land in ``Proc.match``) and raises if none does."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                            start_new_session=True, cwd=cwd)
    p = Proc(name, proc)

    def pump() -> None:
        for line in proc.stdout:
            p.lines.append(line)
            m = ready.search(line.strip()) if not p.ready.is_set() else None
            if m:
                p.match.update(m.groupdict())
                p.ready.set()
        p.ready.set()

    threading.Thread(target=pump, daemon=True).start()
    if wait and not p.wait_ready(timeout):
        p.kill()
        raise RuntimeError(f"{name} did not become ready within {timeout:.0f}s:\n{p.output[-4000:]}")
    return p


def wait_exit(proc: subprocess.Popen, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return proc.returncode
        time.sleep(0.1)
    raise AssertionError(f"process {proc.pid} still running after {timeout}s")
