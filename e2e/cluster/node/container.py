"""One container of a pod: its process across restarts, its log files and its status.

A `ContainerRun` is one start of the container (one process, one log file, its probes);
a `Container` holds the runs, the restart count and back-off, and renders the
containerStatuses entry the API shows.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .. import processes
from ..config import REPO_ROOT
from .probes import Prober, Target

LAUNCHER = Path(__file__).with_name("launch.py")
PYTHON = REPO_ROOT / ".venv" / "bin" / "python"


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclasses.dataclass
class LaunchSpec:
    argv: list[str]
    env: dict[str, str]
    cwd: str
    mounts: list[dict[str, Any]]
    netns: str | None
    utsns: str | None
    hostname: str
    # host folders the container's programs live in (the repository, Python); a volume
    # mounted over one of their parents (e.g. an emptyDir at /tmp with the repo under
    # /tmp) must not hide them, so the launcher binds them back on top
    keep: list[str] = dataclasses.field(default_factory=list)


class ContainerRun:
    """One process of the container, started through the launcher."""

    def __init__(self, spec: LaunchSpec, log_path: Path, spec_path: Path) -> None:
        spec_path.write_text(json.dumps(dataclasses.asdict(spec)))
        log_path.parent.mkdir(parents=True, exist_ok=True)
        python = str(PYTHON) if PYTHON.exists() else sys.executable
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [python, "-I", str(LAUNCHER), str(spec_path)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, close_fds=True,
            )
        processes._children[self.proc.pid] = self.proc
        self.pid = self.proc.pid
        self.log_path = log_path
        self.spec = spec
        self.started_at = now_iso()
        self.started_mono = time.monotonic()
        self.finished_at: str | None = None
        self.exit_code: int | None = None
        self.killed_reason: str | None = None  # why the node killed it (liveness, deletion)
        self.probers: list[Prober] = []
        self._kill_lock = threading.Lock()

    def poll(self) -> int | None:
        if self.exit_code is None:
            code = self.proc.poll()
            if code is not None:
                self.exit_code = 128 - code if code < 0 else code  # -9 -> 137, as runtimes say
                self.finished_at = now_iso()
                processes._children.pop(self.pid, None)
                for p in self.probers:
                    p.stop()
        return self.exit_code

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, grace: float, reason: str) -> None:
        """SIGTERM the container's process group, SIGKILL after `grace` seconds (blocking)."""
        with self._kill_lock:
            if self.killed_reason is None:
                self.killed_reason = reason
        for p in self.probers:
            p.stop()
        if self.poll() is not None:
            return
        self.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if self.poll() is not None:
                break
            time.sleep(0.05)
        # Also catches children that outlived the main process in its group.
        self.signal(signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.poll()

    def stop_async(self, grace: float, reason: str) -> None:
        threading.Thread(target=self.stop, args=(grace, reason), daemon=True).start()

    def start_probes(self, spec: dict, pod_ip: str, on_change) -> None:
        ports = {p["name"]: p["containerPort"] for p in spec.get("ports") or [] if p.get("name")}
        target = Target(pod_ip, ports, self.pid, self.spec.env, self.spec.cwd)
        for kind, key in (("startup", "startupProbe"), ("liveness", "livenessProbe"),
                          ("readiness", "readinessProbe")):
            if spec.get(key):
                prober = Prober(kind, spec[key], target, lambda k, ok, msg: on_change(self, k, ok, msg))
                self.probers.append(prober)
        # Liveness and readiness wait for the startup probe (started by the worker).
        for p in self.probers:
            if p.kind == "startup" or not any(q.kind == "startup" for q in self.probers):
                p.start()

    def start_after_startup(self) -> None:
        for p in self.probers:
            if p.kind != "startup" and not p.is_alive() and p.ident is None:
                p.start()


class Container:
    """A container of the pod across restarts."""

    def __init__(self, spec: dict[str, Any], init: bool) -> None:
        self.spec = spec
        self.name = spec["name"]
        self.init = init
        self.restart_count = 0
        self.crash_streak = 0  # consecutive short runs: the back-off exponent
        self.run: ContainerRun | None = None
        self.last: ContainerRun | None = None  # the previous, terminated run
        self.waiting: tuple[str, str] = ("ContainerCreating", "")
        self.next_start = 0.0  # monotonic time before which no restart happens
        self.started = False  # startup probe passed (or none)
        self.ready = False
        self.done = False  # terminated and will not be restarted

    @property
    def has_readiness(self) -> bool:
        return bool(self.spec.get("readinessProbe"))

    def backoff(self, initial: float, maximum: float) -> float:
        return min(initial * (2 ** self.crash_streak), maximum)

    def status(self, image_id: str) -> dict[str, Any]:
        run = self.run
        st: dict[str, Any] = {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": image_id,
            "restartCount": self.restart_count,
            "ready": bool(self.ready and run is not None and run.exit_code is None),
            "started": bool(self.started and run is not None and run.exit_code is None),
            "lastState": {},
        }
        if run is not None:
            st["containerID"] = f"kubeshard://{run.pid}"
        if run is not None and run.exit_code is None:
            st["state"] = {"running": {"startedAt": run.started_at}}
        elif run is not None and self.done:
            st["state"] = {"terminated": _terminated(run)}
        else:
            reason, message = self.waiting
            st["state"] = {"waiting": {"reason": reason, **({"message": message} if message else {})}}
        if self.last is not None:
            st["lastState"] = {"terminated": _terminated(self.last)}
        return st


def _terminated(run: ContainerRun) -> dict[str, Any]:
    code = run.exit_code if run.exit_code is not None else 137
    reason = "Completed" if code == 0 else "Error"
    out = {"exitCode": code, "reason": reason, "startedAt": run.started_at,
           "finishedAt": run.finished_at or now_iso(), "containerID": f"kubeshard://{run.pid}"}
    if code > 128:
        out["signal"] = code - 128
    return out
