"""The shape of one local cluster: addresses, ports, node sizes and where state lives.

Everything the components, the node (kubelet, containerd, CNI) and the DNS server must
agree on is computed here once and handed down, so no module invents an address of its
own. Pod and Service addresses live only on the node's interface and in the pods'
network namespaces.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

CLUSTER_DOMAIN = "cluster.local"


@dataclasses.dataclass(frozen=True)
class NodeSpec:
    """The node: its name, pod CIDR and what it advertises."""

    name: str
    pod_cidr: str
    cpu: str
    memory: str
    gpus: int
    kubelet_port: int

    @property
    def gateway(self) -> str:
        """The node's address: the first IP of its pod CIDR, on the node's interface."""
        return str(next(ipaddress.ip_network(self.pod_cidr).hosts()))


def _under_state_dir(name: str) -> property:
    """A ClusterConfig path: ``name`` in its state_dir."""
    return property(lambda config: config.state_dir / name, doc=f"state_dir / {name!r}")


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    state_dir: Path
    bin_dir: Path
    instance: int = 0
    nodes: int = 1
    node_cpu: str = "16"
    node_memory: str = "64Gi"
    node_gpus: int = 0
    cluster_cidr: str = "10.244.0.0/16"
    service_cidr: str = "10.96.0.0/16"
    # Uncommon ports, so the harness does not collide with other local Kubernetes
    # setups (16443, 6443, 2379 are often taken), and below Linux's ephemeral range
    # (32768-60999 by default): a port in it can be held by any outgoing connection's
    # local end, which made the cluster's start fail at random ("in use, unknown owner").
    apiserver_port: int = 26443
    etcd_client_port: int = 26379
    etcd_peer_port: int = 26380
    controller_manager_port: int = 26257
    scheduler_port: int = 26259
    kube_proxy_healthz_port: int = 26256
    kube_proxy_metrics_port: int = 26249
    dns_port: int = 26053
    kubelet_port: int = 10250
    kubelet_healthz_port: int = 10248
    netpol_healthz_port: int = 26244
    # The kubelet waits 10 s, doubling to 5 min, before restarting a crashed container;
    # tests want to see several restarts in seconds, so the local node starts lower.
    restart_backoff_initial_s: float = 1.0
    restart_backoff_max_s: float = 30.0

    # ---- derived addresses -------------------------------------------------------
    @property
    def node_specs(self) -> list[NodeSpec]:
        net = ipaddress.ip_network(self.cluster_cidr)
        subnets = net.subnets(new_prefix=24)
        return [
            NodeSpec(
                name=f"kubeshard-node-{i}",
                pod_cidr=str(next(subnets)),
                cpu=self.node_cpu,
                memory=self.node_memory,
                gpus=self.node_gpus,
                kubelet_port=self.kubelet_port,
            )
            for i in range(self.nodes)
        ]

    @classmethod
    def for_instance(cls, instance: int, **fields) -> "ClusterConfig":
        """Cluster number `instance` on this machine: instance 0 has the defaults; each
        further one shifts every port by 1000 and the pod and Service ranges by one in
        the second octet, so the ranges of two state dirs never overlap (one node, though,
        runs per machine: the kubelet's ports are its own)."""
        if instance == 0:
            return cls(**fields)
        shifted = {f.name: getattr(cls, f.name) + 1000 * instance for f in dataclasses.fields(cls)
                   if f.name.endswith("_port") and f.name != "kubelet_port"}
        for name in ("cluster_cidr", "service_cidr"):
            a, b, rest = getattr(cls, name).split(".", 2)
            shifted[name] = f"{a}.{int(b) + instance}.{rest}"
        return cls(**{**shifted, "instance": instance, **fields})

    @property
    def advertise_address(self) -> str:
        """Where pods reach the API server: the node's address (the API server listens on it)."""
        return self.node_specs[0].gateway

    @property
    def kubernetes_service_ip(self) -> str:
        return str(ipaddress.ip_network(self.service_cidr)[1])

    @property
    def dns_service_ip(self) -> str:
        return str(ipaddress.ip_network(self.service_cidr)[10])

    @property
    def apiserver_url(self) -> str:
        return f"https://127.0.0.1:{self.apiserver_port}"

    # ---- state layout ------------------------------------------------------------
    pki_dir = _under_state_dir("pki")
    log_dir = _under_state_dir("logs")
    pid_dir = _under_state_dir("pids")
    kubeconfig = _under_state_dir("kubeconfig")
    config_file = _under_state_dir("cluster.json")

    def component_kubeconfig(self, name: str) -> Path:
        return self.state_dir / "kubeconfigs" / f"{name}.kubeconfig"

    # ---- persistence: the DNS process reads the same config ------------------------
    @property
    def run_dir(self) -> Path:
        """Sockets and runtime state of the real node: short paths (a unix socket path
        must stay under 108 bytes) under /run, one folder per state dir."""
        import hashlib

        return Path("/run/kubeshard") / hashlib.sha256(str(self.state_dir).encode()).hexdigest()[:12]

    def save(self) -> None:
        data = dataclasses.asdict(self)
        data["state_dir"] = str(self.state_dir)
        data["bin_dir"] = str(self.bin_dir)
        self.config_file.write_text(json.dumps(data, indent=2))

    @classmethod
    def load(cls, path: Path) -> "ClusterConfig":
        data = json.loads(Path(path).read_text())
        # a state dir written by an older harness may hold fields this one dropped
        known = {f.name for f in dataclasses.fields(cls)}
        data = {k: v for k, v in data.items() if k in known}
        data["state_dir"] = Path(data["state_dir"])
        data["bin_dir"] = Path(data["bin_dir"])
        return cls(**data)


def default_state_dir() -> Path:
    return Path(os.environ.get("KUBESHARD_CLUSTER_DIR", REPO_ROOT / ".cache" / "cluster"))
