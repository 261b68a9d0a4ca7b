"""Detached child processes with pid files, so `up` can exit and `down` can find them.

Each process runs in its own session (a process group of its own), so stopping it
signals its whole tree. A pid file records the pid and the process's start time: a pid
reused by an unrelated process after a crash is never signalled.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

# Children of this process, kept so they are reaped (no zombies while pytest runs).
_children: dict[int, subprocess.Popen] = {}


def start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (clock ticks since boot), or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):  # exited, not yet reaped
        return None
    return fields[19]


def is_alive(pid: int, started: str | None = None) -> bool:
    child = _children.get(pid)
    if child is not None and child.poll() is not None:
        return False
    now = start_time(pid)
    return now is not None and (started is None or now == started)


def spawn(name: str, argv: list[str], *, pid_dir: Path, log_path: Path,
          env: dict[str, str] | None = None, cwd: Path | None = None) -> int:
    """Start `argv` detached, logging to `log_path`; returns its pid."""
    pid_dir.mkdir(parents=True, exist_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, env=env, cwd=cwd, close_fds=True,
        )
    _children[proc.pid] = proc
    (pid_dir / f"{name}.pid").write_text(f"{proc.pid} {start_time(proc.pid) or ''}\n")
    return proc.pid


def read_pid(name: str, pid_dir: Path) -> tuple[int, str | None] | None:
    try:
        parts = (pid_dir / f"{name}.pid").read_text().split()
    except OSError:
        return None
    return int(parts[0]), (parts[1] if len(parts) > 1 else None)


def running(name: str, pid_dir: Path) -> int | None:
    """The pid of the recorded process `name` if it is still the same live process."""
    rec = read_pid(name, pid_dir)
    if rec is None:
        return None
    pid, started = rec
    return pid if is_alive(pid, started) else None


def wait_exit(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    child = _children.get(pid)
    while time.monotonic() < deadline:
        if child is not None:
            try:
                child.wait(timeout=0.05)
                return True
            except subprocess.TimeoutExpired:
                continue
        if start_time(pid) is None:
            return True
        time.sleep(0.05)
    return False


def terminate(pid: int, timeout: float) -> None:
    """SIGTERM the process group of `pid`, then SIGKILL it after `timeout` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:
            os.kill(pid, sig)
        if wait_exit(pid, timeout if sig == signal.SIGTERM else 5.0):
            break
    _children.pop(pid, None)


def stop(name: str, pid_dir: Path, timeout: float = 10.0) -> None:
    pid = running(name, pid_dir)
    if pid is not None:
        terminate(pid, timeout)
    (pid_dir / f"{name}.pid").unlink(missing_ok=True)

