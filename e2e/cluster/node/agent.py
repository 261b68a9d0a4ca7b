"""A process-backed node: registers a Node, keeps its lease, runs the pods bound to it.

It speaks to the API server as `system:node:<name>` (group system:nodes), so the Node
authorizer and NodeRestriction admission limit it exactly as they limit a kubelet: it
reads only the Secrets and ConfigMaps of its own pods and requests tokens only for them.
"""

from __future__ import annotations

import datetime
import logging
import os
import platform
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..config import ClusterConfig, NodeSpec
from . import network
from .api import Api, ApiError, informer
from .kubelet_api import KubeletServer
from .pod import NodeContext, PodWorker
from .volumes import Mountpoints

log = logging.getLogger("kubeshard.node")

KUBE_VERSION = "v1.37.2"
LEASE_SECONDS = 40
LEASE_RENEW_S = 10.0
STATUS_EVERY_S = 30.0


def _micro_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class NodeAgent:
    def __init__(self, config: ClusterConfig, node: NodeSpec, mountpoints: Mountpoints) -> None:
        self.config = config
        self.node = node
        self.api = Api(config.component_kubeconfig(f"node-{node.name}"))
        self.stopping = threading.Event()
        self.workers: dict[str, PodWorker] = {}
        self.workers_lock = threading.Lock()
        self.events = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"events-{node.name}")
        self.allocatable = {"cpu": node.cpu, "memory": node.memory, "pods": "110",
                            "ephemeral-storage": "100Gi"}
        if node.gpus:
            self.allocatable["nvidia.com/gpu"] = str(node.gpus)
        self.ctx = NodeContext(
            config=config, node=node, api=self.api, ipam=network.Ipam(node.pod_cidr),
            mountpoints=mountpoints, allocatable=self.allocatable, event=self._event,
            forget=self._forget,
        )
        self.boot_id = str(uuid.uuid4())
        self.kubelet_api: KubeletServer | None = None

    # ---- registration and heartbeats ----------------------------------------------------
    def _node_status(self) -> dict[str, Any]:
        now = _now()

        def cond(kind: str, status: str, reason: str, message: str) -> dict:
            return {"type": kind, "status": status, "reason": reason, "message": message,
                    "lastHeartbeatTime": now, "lastTransitionTime": self.started_at}

        return {
            "capacity": dict(self.allocatable),
            "allocatable": dict(self.allocatable),
            "conditions": [
                cond("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
                cond("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
                cond("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
                cond("Ready", "True", "KubeletReady", "kubeshard local node is posting ready status"),
            ],
            "addresses": [{"type": "InternalIP", "address": self.node.gateway},
                          {"type": "Hostname", "address": self.node.name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.node.kubelet_port}},
            "nodeInfo": {
                "machineID": uuid.uuid5(uuid.NAMESPACE_DNS, self.node.name).hex,
                "systemUUID": str(uuid.uuid5(uuid.NAMESPACE_DNS, self.node.name)),
                "bootID": self.boot_id,
                "kernelVersion": platform.release(),
                "osImage": "kubeshard local node (processes)",
                "containerRuntimeVersion": "kubeshard-process://0.1",
                "kubeletVersion": KUBE_VERSION,
                "kubeProxyVersion": KUBE_VERSION,
                "operatingSystem": "linux",
                "architecture": "amd64" if platform.machine() == "x86_64" else platform.machine(),
            },
        }

    def register(self) -> None:
        self.started_at = _now()
        arch = "amd64" if platform.machine() == "x86_64" else platform.machine()
        body = {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {
                "name": self.node.name,
                "labels": {
                    "kubernetes.io/hostname": self.node.name, "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": arch, "beta.kubernetes.io/os": "linux",
                    "beta.kubernetes.io/arch": arch, "kubeshard.io/local-node": "true",
                },
            },
            "spec": {"podCIDR": self.node.pod_cidr, "podCIDRs": [self.node.pod_cidr]},
        }
        try:
            self.api.create("/api/v1/nodes", body)
        except ApiError as e:
            if e.status != 409:
                raise
        self.api.patch(f"/api/v1/nodes/{self.node.name}/status", {"status": self._node_status()})
        self._renew_lease()

    def _renew_lease(self) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.node.name}"
        spec = {"holderIdentity": self.node.name, "leaseDurationSeconds": LEASE_SECONDS,
                "renewTime": _micro_now()}
        try:
            self.api.patch(path, {"spec": spec}, kind="merge-patch")
        except ApiError as e:
            if e.status != 404:
                raise
            self.api.create(path.rsplit("/", 1)[0], {
                "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": self.node.name, "namespace": "kube-node-lease"}, "spec": spec,
            })

    def _heartbeat(self) -> None:
        since_status = 0.0
        while not self.stopping.wait(LEASE_RENEW_S):
            try:
                self._renew_lease()
                since_status += LEASE_RENEW_S
                if since_status >= STATUS_EVERY_S:
                    self.api.patch(f"/api/v1/nodes/{self.node.name}/status", {"status": self._node_status()})
                    since_status = 0.0
            except Exception as e:  # the API server restarting is not our end
                log.warning("node %s: heartbeat failed: %s", self.node.name, e)

    # ---- pods ----------------------------------------------------------------------------
    def _event(self, pod: dict, kind: str, reason: str, message: str) -> None:
        meta = pod["metadata"]
        now = _now()
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta["uid"]},
            "reason": reason, "message": message[:1024], "type": kind,
            "source": {"component": "kubelet", "host": self.node.name},
            "reportingComponent": "kubelet", "reportingInstance": self.node.name,
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }

        def send() -> None:
            try:
                self.api.create(f"/api/v1/namespaces/{meta['namespace']}/events", body)
            except Exception as e:
                log.debug("event %s for %s dropped: %s", reason, meta["name"], e)

        if not self.stopping.is_set():
            self.events.submit(send)

    def _forget(self, uid: str) -> None:
        with self.workers_lock:
            self.workers.pop(uid, None)

    def _on_pod(self, etype: str, obj: Any) -> None:
        if etype == "SYNC":
            uids = {p["metadata"]["uid"] for p in obj}
            with self.workers_lock:
                stale = [w for uid, w in self.workers.items() if uid not in uids]
            for w in stale:
                w.remove()
            for pod in obj:
                self._on_pod("MODIFIED", pod)
            return
        uid = obj["metadata"]["uid"]
        with self.workers_lock:
            worker = self.workers.get(uid)
            if etype == "DELETED":
                if worker is not None:
                    worker.remove()
                return
            if worker is not None:
                worker.update(obj)
                return
            phase = (obj.get("status") or {}).get("phase")
            if phase in ("Succeeded", "Failed") and not obj["metadata"].get("deletionTimestamp"):
                return  # finished before this agent started; nothing to run
            if self.stopping.is_set():
                return
            worker = PodWorker(self.ctx, obj)
            self.workers[uid] = worker
        worker.start()

    # ---- logs for the kubelet API and tests ------------------------------------------
    def find_logs(self, ns: str, pod: str, container: str, previous: bool):
        with self.workers_lock:
            worker = next((w for w in self.workers.values() if w.ns == ns and w.name == pod), None)
        if worker is not None:
            c = next((c for c in worker.init + worker.main if c.name == container), None)
            if c is None:
                return None
            index = c.restart_count - (1 if previous else 0)
            if index < 0:
                return None
            path = worker.dir / container / f"{index}.log"
            is_current = not previous

            def running() -> bool:
                run = c.run
                return is_current and run is not None and run.exit_code is None and \
                    run.log_path == path and not worker.removed
            return path, running
        dirs = sorted(self.config.pods_dir.glob(f"{ns}_{pod}_*"), key=lambda d: d.stat().st_mtime)
        if not dirs:
            return None
        logs = sorted((dirs[-1] / container).glob("*.log"), key=lambda p: int(p.stem))
        if len(logs) < (2 if previous else 1):
            return None
        return logs[-2 if previous else -1], lambda: False

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self.register()
        pki = self.config.pki_dir
        self.kubelet_api = KubeletServer(
            (self.node.gateway, self.node.kubelet_port), pki / f"kubelet-{self.node.name}.crt",
            pki / f"kubelet-{self.node.name}.key", pki / "ca.crt", self.find_logs)
        self.kubelet_api.start()
        threading.Thread(target=self._heartbeat, daemon=True, name=f"heartbeat-{self.node.name}").start()
        threading.Thread(
            target=informer, daemon=True, name=f"pods-{self.node.name}",
            args=(self.api, "/api/v1/pods", self._on_pod, self.stopping.is_set),
            kwargs={"fieldSelector": f"spec.nodeName={self.node.name}"},
        ).start()

    def stop(self, timeout: float = 20.0) -> None:
        """Kill every pod's processes and sandbox (the cluster is going away)."""
        self.stopping.set()
        with self.workers_lock:
            workers = list(self.workers.values())
        for w in workers:
            w.remove()
        for w in workers:
            w.join(timeout=timeout)
        if self.kubelet_api is not None:
            self.kubelet_api.shutdown()
        self.events.shutdown(wait=False, cancel_futures=True)


def container_pid(config: ClusterConfig, ns: str, pod: str, container: str) -> int:
    """The pid of a running container, from the files the pod worker writes (for exec)."""
    dirs = sorted(config.pods_dir.glob(f"{ns}_{pod}_*"), key=lambda d: d.stat().st_mtime)
    pid_file = dirs[-1] / container / "pid" if dirs else None
    if pid_file is None or not pid_file.exists():
        raise LookupError(f"container {container} of pod {ns}/{pod} has never run on the local node")
    pid = int(pid_file.read_text())
    if not os.path.exists(f"/proc/{pid}"):
        raise LookupError(f"container {container} of pod {ns}/{pod} is not running")
    return pid
