"""The life of one pod on the local node, from sandbox to finalized deletion.

A `PodWorker` thread owns one pod: it creates the sandbox (network namespace and IP),
materializes volumes, runs init containers in order, then the containers, restarts them
per restartPolicy with exponential back-off, acts on probe results, publishes status
when it changes, and on deletion stops every container (SIGTERM, SIGKILL after the
grace period) before removing the pod object, as the kubelet does.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ..config import REPO_ROOT, ClusterConfig, NodeSpec
from . import env as envmod
from . import etc_files, images, network
from . import status as statusmod
from .api import Api, ApiError
from .container import Container, ContainerRun, LaunchSpec, now_iso
from .volumes import Mountpoints, PodVolumes, VolumeError

log = logging.getLogger("kubeshard.node")


@dataclasses.dataclass
class NodeContext:
    """What every pod worker of one node shares."""

    config: ClusterConfig
    node: NodeSpec
    api: Api
    ipam: network.Ipam
    mountpoints: Mountpoints
    allocatable: dict[str, str]
    event: Callable[[dict, str, str, str], None]  # (pod, type, reason, message)
    forget: Callable[[str], None]  # the worker of this uid has finished


def pod_dir(config: ClusterConfig, ns: str, name: str, uid: str) -> Path:
    return config.pods_dir / f"{ns}_{name}_{uid}"


# Containers are processes on this host: they need the repository (the entrypoints,
# .venv) and the Python that .venv links to. A volume mounted over a parent of those
# (an emptyDir at /tmp while the clone lives in /tmp) is fine: the launcher binds them
# back on top. A volume over one of them, or over a system folder, cannot work.
_ESSENTIAL = [REPO_ROOT, Path(os.path.realpath(sys.base_prefix))]
_SYSTEM = {"/", "/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc", "/proc", "/sys", "/dev", "/run", "/var"}


def _hides_host_essentials(target: str) -> bool:
    path = Path(os.path.normpath(target))
    return str(path) in _SYSTEM or any(p == path or p in path.parents for p in _ESSENTIAL)


class PodWorker(threading.Thread):
    def __init__(self, ctx: NodeContext, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        super().__init__(daemon=True, name=f"pod-{meta['namespace']}/{meta['name']}")
        self.ctx = ctx
        self.pod = pod
        self.uid, self.ns, self.name = meta["uid"], meta["namespace"], meta["name"]
        self.dir = pod_dir(ctx.config, self.ns, self.name, self.uid)
        self.lock = threading.RLock()
        self.wake = threading.Event()
        self.deleting = bool(meta.get("deletionTimestamp"))
        self.removed = False
        spec = pod["spec"]
        self.init = [Container(c, True) for c in spec.get("initContainers") or []]
        self.main = [Container(c, False) for c in spec["containers"]]
        self.sandbox: network.Sandbox | None = None
        self.volumes: PodVolumes | None = None
        self.mount_refs: list[str] = []
        self.failed_init = False
        self.terminal = False
        self.start_time = now_iso()
        self.transitions: dict[str, tuple[bool, str]] = {}
        self.last_status: dict | None = None
        self.setup_retry_at = 0.0
        self.pod_ip: str | None = None

    # ---- called from the node's watch thread -----------------------------------------
    def update(self, pod: dict[str, Any]) -> None:
        with self.lock:
            self.pod = pod
            if pod["metadata"].get("deletionTimestamp"):
                self.deleting = True
        self.wake.set()

    def remove(self) -> None:
        self.removed = True
        self.wake.set()

    # ---- main loop ---------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._loop()
        except Exception:
            log.exception("pod worker %s/%s crashed", self.ns, self.name)
        finally:
            self._teardown()
            self.ctx.forget(self.uid)

    def _loop(self) -> None:
        while True:
            if self.removed:
                return
            if self.deleting:
                self._graceful_stop()
                self._finalize()
                return
            with self.lock:
                if self.terminal:
                    pass  # finished: wait for the pod's deletion
                elif self.sandbox is None:
                    self._setup()
                else:
                    self._step()
            self._publish()
            self.wake.wait(5.0 if self.terminal else 0.25)
            self.wake.clear()

    # ---- sandbox and volumes -----------------------------------------------------------
    def _setup(self) -> None:
        if time.monotonic() < self.setup_retry_at:
            return
        spec = self.pod["spec"]
        try:
            if self.sandbox is None:
                self.dir.mkdir(parents=True, exist_ok=True)
                if spec.get("hostNetwork"):
                    sandbox = network.host_network(self.uid, self.ctx.node)
                else:
                    ip = self.ctx.ipam.allocate()
                    try:
                        sandbox = network.create(self.uid, ip, self.ctx.node, self.ctx.config)
                    except Exception:
                        self.ctx.ipam.release(ip)
                        raise
                volumes = PodVolumes(
                    self.pod, self.dir, api_get=self.ctx.api.get, request_token=self._token,
                    allocatable=self.ctx.allocatable,
                    pod_ip=sandbox.ip, host_ip=self.ctx.node.gateway,
                )
                try:
                    volumes.setup()
                except Exception:
                    volumes.cleanup()
                    network.destroy(sandbox)
                    if sandbox.pid is not None:
                        self.ctx.ipam.release(sandbox.ip)
                    raise
                etc_files.write(self.pod, self.dir / "etc", sandbox.ip, self.ctx.config.dns_service_ip)
                self.volumes, self.sandbox = volumes, sandbox
                self.pod_ip = sandbox.ip
        except (VolumeError, ApiError, network.SandboxError, OSError) as e:
            # The Node authorizer learns about a new pod's Secrets a moment after the
            # pod is bound, so a 403 here is usually transient: retry.
            log.warning("pod %s/%s: setup failed: %s", self.ns, self.name, e)
            for c in self.init + self.main:
                c.waiting = ("ContainerCreating", str(e))
            self.ctx.event(self.pod, "Warning", "FailedMount", str(e))
            self.setup_retry_at = time.monotonic() + 2.0

    def _token(self, source: dict) -> str:
        sa = self.pod["spec"].get("serviceAccountName") or "default"
        body = {
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "spec": {
                "audiences": [source["audience"]] if source.get("audience") else None,
                "expirationSeconds": int(source.get("expirationSeconds") or 3600),
                "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": self.name, "uid": self.uid},
            },
        }
        resp = self.ctx.api.create(f"/api/v1/namespaces/{self.ns}/serviceaccounts/{sa}/token", body)
        return resp["status"]["token"]

    # ---- containers --------------------------------------------------------------------
    def _step(self) -> None:
        policy = self.pod["spec"].get("restartPolicy", "Always")
        now = time.monotonic()
        pending_init = [c for c in self.init if not c.done]
        if self.failed_init:
            self._become_terminal()
            return
        if pending_init:
            c = pending_init[0]
            if c.run is None:
                if now >= c.next_start:
                    self._start(c)
            elif c.run.poll() is not None:
                if c.run.exit_code == 0:
                    c.done = True
                    self.wake.set()
                elif policy == "Never":
                    c.done = True
                    self.failed_init = True
                else:
                    self._schedule_restart(c)
            return
        for c in self.main:
            if c.done:
                continue
            if c.run is None:
                if now >= c.next_start:
                    self._start(c)
                continue
            code = c.run.poll()
            if code is None:
                continue
            c.ready = c.started = False
            if policy == "Always" or (policy == "OnFailure" and code != 0):
                self._schedule_restart(c)
            else:
                c.done = True
        if all(c.done for c in self.main):
            self._become_terminal()

    def _schedule_restart(self, c: Container) -> None:
        run = c.run
        assert run is not None
        cfg = self.ctx.config
        # A container that ran well beyond the longest back-off starts over from the shortest.
        if time.monotonic() - run.started_mono > 2 * cfg.restart_backoff_max_s:
            c.crash_streak = 0
        delay = c.backoff(cfg.restart_backoff_initial_s, cfg.restart_backoff_max_s)
        c.crash_streak += 1
        c.last, c.run = run, None
        c.next_start = time.monotonic() + delay
        c.waiting = ("CrashLoopBackOff",
                     f"back-off {delay:g}s restarting failed container={c.name} "
                     f"pod={self.name}_{self.ns}({self.uid})")
        self.ctx.event(self.pod, "Warning", "BackOff", f"Back-off restarting failed container {c.name}")

    def _start(self, c: Container) -> None:
        spec = c.spec
        assert self.sandbox is not None and self.volumes is not None
        try:
            image = images.resolve(spec.get("image", ""), self.ctx.config.state_dir)
        except images.ImageNotFound as e:
            if c.waiting[0] != "ErrImagePull":
                self.ctx.event(self.pod, "Warning", "Failed", f"Failed to pull image: {e}")
            c.waiting = ("ErrImagePull", str(e))
            c.next_start = time.monotonic() + 10
            return
        try:
            env = self._env(spec, image)
            command = [envmod.expand(a, env) for a in spec.get("command") or []]
            args = [envmod.expand(a, env) for a in spec.get("args") or []]
            argv = image.argv(command or None, args or None)
            mounts = self.volumes.mounts(spec) + self._etc_mounts()
        except (envmod.EnvError, VolumeError, ValueError, ApiError) as e:
            c.waiting = ("CreateContainerConfigError", str(e))
            c.next_start = time.monotonic() + 2
            self.ctx.event(self.pod, "Warning", "Failed", f"Error: {e}")
            return
        hidden = [m["target"] for m in mounts if _hides_host_essentials(m["target"])]
        if hidden:
            c.waiting = ("CreateContainerConfigError",
                         f"mountPath {hidden[0]} would hide {REPO_ROOT} or the Python installation "
                         "that containers run from on the kubeshard local node; choose another path")
            c.next_start = time.monotonic() + 30
            return
        for m in mounts:
            self.mount_refs.append(self.ctx.mountpoints.ensure(m["target"], Path(m["source"]).is_dir()))
        if c.run is None and c.last is not None:
            c.restart_count += 1
        cdir = self.dir / c.name
        cdir.mkdir(parents=True, exist_ok=True)
        launch = LaunchSpec(
            argv=argv, env=env, cwd=spec.get("workingDir") or str(REPO_ROOT), mounts=mounts,
            netns=self.sandbox.ns_path("net"), utsns=self.sandbox.ns_path("uts"),
            hostname=self.pod["spec"].get("hostname") or self.name,
            keep=[str(p) for p in _ESSENTIAL],
        )
        run = ContainerRun(launch, cdir / f"{c.restart_count}.log", cdir / f"{c.restart_count}.json")
        (cdir / "pid").write_text(str(run.pid))
        c.run = run
        c.waiting = ("ContainerCreating", "")
        c.started = not spec.get("startupProbe")
        c.ready = c.started and not spec.get("readinessProbe")
        if not c.init:
            run.start_probes(spec, self.sandbox.ip, self._on_probe)
        self.ctx.event(self.pod, "Normal", "Started", f"Started container {c.name}")

    def _env(self, spec: dict, image: images.Image) -> dict[str, str]:
        api = self.ctx.api
        services: dict[str, str] = {}
        master = api.get("/api/v1/namespaces/default/services/kubernetes")
        if master is not None:
            # Pods reach the API through its Service IP (kube-proxy and hostnet DNAT).
            services.update(envmod.service_links([], master))
        if self.pod["spec"].get("enableServiceLinks", True):
            listing = api.get(f"/api/v1/namespaces/{self.ns}/services") or {}
            others = [s for s in listing.get("items") or [] if not (
                self.ns == "default" and s["metadata"]["name"] == "kubernetes")]
            services.update(envmod.service_links(others, None))
        return envmod.build(
            self.pod, spec, image_path=image.path_env, pod_ip=self.sandbox.ip,
            host_ip=self.ctx.node.gateway, services=services, allocatable=self.ctx.allocatable,
            get_configmap=lambda n: api.get(f"/api/v1/namespaces/{self.ns}/configmaps/{n}"),
            get_secret=lambda n: api.get(f"/api/v1/namespaces/{self.ns}/secrets/{n}"),
        )

    def _etc_mounts(self) -> list[dict[str, Any]]:
        etc = self.dir / "etc"
        mounts = [{"source": str(etc / "hosts"), "target": "/etc/hosts", "readOnly": False}]
        if self.sandbox is not None and self.sandbox.pid is not None:
            mounts.append({"source": str(etc / "hostname"), "target": "/etc/hostname", "readOnly": False})
        if (etc / "resolv.conf").exists():
            mounts.append({"source": str(etc / "resolv.conf"), "target": "/etc/resolv.conf",
                           "readOnly": False})
        return mounts

    def _on_probe(self, run: ContainerRun, kind: str, ok: bool, message: str) -> None:
        with self.lock:
            c = next((c for c in self.main if c.run is run), None)
            if c is None:
                return
            grace = float(c.spec.get(f"{kind}Probe", {}).get("terminationGracePeriodSeconds")
                          or self.pod["spec"].get("terminationGracePeriodSeconds", 30))
            if kind == "startup" and ok:
                c.started = True
                c.ready = not c.has_readiness
                run.start_after_startup()
            elif kind == "readiness":
                c.ready = ok and c.started
                if not ok:
                    self.ctx.event(self.pod, "Warning", "Unhealthy", f"Readiness probe failed: {message}")
            elif not ok:  # liveness or startup failed: kill and let restartPolicy decide
                what = "Liveness" if kind == "liveness" else "Startup"
                self.ctx.event(self.pod, "Warning", "Unhealthy", f"{what} probe failed: {message}")
                self.ctx.event(self.pod, "Normal", "Killing",
                               f"Container {c.name} failed {kind} probe, will be restarted")
                c.ready = False
                run.stop_async(grace, f"{kind} probe failed")
        self.wake.set()

    def _become_terminal(self) -> None:
        """Succeeded or Failed: the kubelet frees the sandbox but keeps the pod object."""
        self.terminal = True
        for c in self.init + self.main:
            if c.run is not None and c.run.poll() is None:
                c.run.stop(0, "pod finished")
        self._release_sandbox()

    # ---- status ------------------------------------------------------------------------
    def _publish(self) -> None:
        with self.lock:
            st = statusmod.build(
                self.pod, init=self.init, main=self.main,
                pod_ip=self.pod_ip, host_ip=self.ctx.node.gateway,
                start_time=self.start_time, sandbox_ready=self.sandbox is not None or self.terminal,
                failed_init=self.failed_init, transitions=self.transitions,
                image_ids={c.name: f"kubeshard-local://{c.spec.get('image', '')}"
                           for c in self.init + self.main},
            )
        if st == self.last_status:
            return
        try:
            self.ctx.api.patch(f"/api/v1/namespaces/{self.ns}/pods/{self.name}/status",
                               {"metadata": {"uid": self.uid}, "status": st})
            self.last_status = st
        except ApiError as e:
            if e.status in (404, 409):  # deleted, or a new pod of the same name
                self.removed = True
            else:
                log.warning("pod %s/%s: status update failed: %s", self.ns, self.name, e)

    # ---- deletion ----------------------------------------------------------------------
    def _graceful_stop(self) -> None:
        meta = self.pod["metadata"]
        grace = meta.get("deletionGracePeriodSeconds")
        if grace is None:
            grace = self.pod["spec"].get("terminationGracePeriodSeconds", 30)
        runs = [c.run for c in self.init + self.main if c.run is not None and c.run.poll() is None]
        if runs:
            self.ctx.event(self.pod, "Normal", "Killing",
                           f"Stopping container(s) with a grace period of {grace} s")
        threads = [threading.Thread(target=r.stop, args=(float(grace), "pod deleted"), daemon=True)
                   for r in runs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=float(grace) + 20)
        with self.lock:
            for c in self.main:
                c.ready = False
                if c.run is not None:
                    c.done = True
        self._publish()

    def _finalize(self) -> None:
        try:
            self.ctx.api.delete(f"/api/v1/namespaces/{self.ns}/pods/{self.name}",
                                {"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}})
        except ApiError as e:
            if e.status != 409:  # 409: a different pod of that name exists; ours is gone
                log.warning("pod %s/%s: final delete failed: %s", self.ns, self.name, e)

    def _release_sandbox(self) -> None:
        if self.sandbox is not None:
            network.destroy(self.sandbox)
            if self.sandbox.pid is not None:
                self.ctx.ipam.release(self.sandbox.ip)
            self.sandbox = None
        if self.volumes is not None:
            self.volumes.cleanup()
            self.volumes = None
        if self.mount_refs:
            self.ctx.mountpoints.release(self.mount_refs)
            self.mount_refs = []

    def _teardown(self) -> None:
        for c in self.init + self.main:
            if c.run is not None and c.run.poll() is None:
                c.run.stop(0, "pod removed")
        with self.lock:
            self._release_sandbox()
        shutil.rmtree(self.dir / "etc", ignore_errors=True)
