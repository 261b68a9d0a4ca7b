"""One local cluster shared by several pytest sessions (several engineers, one checkout).

Each session registers a file under `sessions/` (its pid and start time) while holding
`.lock`; the last session out stops a cluster that pytest started. A cluster started by
`python -m e2e.cluster up` (owner "up") stays up until `down`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path
from typing import Iterator

from . import processes
from .controlplane import StartupError
from .handle import Cluster
from .local import LocalCluster


@contextlib.contextmanager
def _locked(state_dir: Path, timeout: float = 600.0) -> Iterator[None]:
    state_dir.mkdir(parents=True, exist_ok=True)
    with open(state_dir / ".lock", "w") as f:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise StartupError(f"another process held {state_dir}/.lock for {timeout:.0f} s")
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _live_sessions(state_dir: Path) -> list[Path]:
    live = []
    for f in (state_dir / "sessions").glob("*"):
        try:
            pid, started = f.read_text().split()
        except (OSError, ValueError):
            f.unlink(missing_ok=True)
            continue
        if processes.is_alive(int(pid), started):
            live.append(f)
        else:
            f.unlink(missing_ok=True)
    return live


def acquire(state_dir: Path | None = None, *, persistent: bool = False, **options) -> tuple[LocalCluster, Cluster]:
    """Use the cluster of `state_dir` if it is up, else start it; register this process."""
    cluster = LocalCluster(state_dir, **options)
    with _locked(cluster.state_dir):
        if not cluster.is_running():
            cluster.start()
            (cluster.state_dir / "owner").write_text("up" if persistent else "pytest")
        elif persistent:
            (cluster.state_dir / "owner").write_text("up")
        if not persistent:
            sessions = cluster.state_dir / "sessions"
            sessions.mkdir(exist_ok=True)
            (sessions / str(os.getpid())).write_text(f"{os.getpid()} {processes.start_time(os.getpid())}")
        return cluster, cluster.handle()


def release(cluster: LocalCluster) -> None:
    """Unregister; stop the cluster if pytest started it and no other session uses it."""
    with _locked(cluster.state_dir):
        (cluster.state_dir / "sessions" / str(os.getpid())).unlink(missing_ok=True)
        owner = (cluster.state_dir / "owner").read_text().strip() \
            if (cluster.state_dir / "owner").exists() else "pytest"
        if owner == "pytest" and not _live_sessions(cluster.state_dir):
            cluster.down()
