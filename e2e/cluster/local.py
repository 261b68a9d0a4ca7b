"""LocalCluster: the whole local Kubernetes cluster, started and stopped as one thing.

Start order: the node's network, etcd, kube-apiserver, kube-controller-manager,
kube-scheduler, the node (containerd and the kubelet, which registers the Node; then
kube-router's NetworkPolicy firewall), kube-proxy, cluster DNS. Stop is the reverse,
then every leftover is swept by name (pod sandboxes, shims, the node's interfaces, nft
tables and iptables chains, mounts, cgroups), so `down` also cleans up after a crash.

Sharing one cluster between pytest sessions is in sharing.py.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from dnslib import DNSRecord

from . import controlplane, processes
from .api import Api, ApiError
from .certs import Pki
from .config import REPO_ROOT, ClusterConfig, default_state_dir
from .controlplane import StartupError, wait_healthy
from .handle import Cluster
from .kubelet import RealNode, containerd
from .tools import find_bin_dir

# The processes beside the control plane (controlplane.COMPONENTS), in start order.
ADDONS = ("containerd", "kubelet", "network-policy", "kube-proxy", "cluster-dns")
KUBE_BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kube-proxy",
                 "kubelet", "containerd")
PYTHON = str(REPO_ROOT / ".venv" / "bin" / "python") if (REPO_ROOT / ".venv" / "bin" / "python").exists() \
    else sys.executable


class LocalCluster:
    """The local cluster (control plane and one real node), its state in `state_dir`
    (default .cache/cluster)."""

    def __init__(self, state_dir: Path | None = None, *, nodes: int = 1, node_gpus: int = 0,
                 node_cpu: str = "16", node_memory: str = "64Gi", bin_dir: Path | None = None,
                 instance: int | None = None) -> None:
        self.state_dir = Path(state_dir or default_state_dir()).resolve()
        self._options = dict(nodes=nodes, node_gpus=node_gpus, node_cpu=node_cpu, node_memory=node_memory)
        self._instance = int(os.environ.get("KUBESHARD_CLUSTER_INSTANCE", "0")) if instance is None else instance
        self._bin_dir = bin_dir
        self.config: ClusterConfig | None = None
        if (self.state_dir / "cluster.json").exists():
            self.config = ClusterConfig.load(self.state_dir / "cluster.json")

    # ---- status --------------------------------------------------------------------------
    def is_running(self) -> bool:
        """All components alive and the API server ready."""
        c = self.config
        if c is None:
            return False
        names = controlplane.COMPONENTS + ADDONS
        if any(processes.running(n, c.pid_dir) is None for n in names):
            return False
        try:
            status, _ = controlplane._https_get(c.apiserver_port, "/readyz", Pki.load_or_create(c))
        except OSError:
            return False
        return status == 200

    def handle(self) -> Cluster:
        assert self.config is not None
        return Cluster(str(self.config.kubeconfig), self.config.bin_dir, is_local=True,
                       local_config=self.config)

    # ---- start ---------------------------------------------------------------------------
    def start(self, timeout: float = 180.0) -> Cluster:
        _preflight()
        bin_dir = self._bin_dir or find_bin_dir()
        self.down()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        c = ClusterConfig.for_instance(self._instance, state_dir=self.state_dir, bin_dir=bin_dir,
                                       **self._options)
        real_node = RealNode(c)
        real_node.prepare()  # builds images and tools the first time: minutes
        self.config = c
        for stale in (c.state_dir / "etcd", c.log_dir):
            shutil.rmtree(stale, ignore_errors=True)
        c.state_dir.mkdir(parents=True, exist_ok=True)
        c.save()
        try:
            pki = Pki.load_or_create(c)
            real_node.network_setup()
            controlplane.start(c, pki, timeout=timeout)
            api = Api(c.kubeconfig)
            _create_dns_service(api, c)
            real_node.start(pki, self._spawn, timeout)
            for node in c.node_specs:
                wait_healthy("kubelet", lambda n=node.name: _node_ready(api, n), c, timeout)
            real_node.advertise_gpus(api)
            real_node.start_network_policy(api, self._spawn, timeout)
            self._spawn("kube-proxy", _kube_proxy_argv(c))
            wait_healthy("kube-proxy", lambda: _kube_proxy_synced(c), c, timeout)
            self._spawn_python("cluster-dns", "e2e.cluster.dns")
            wait_healthy("cluster-dns", lambda: _dns_answers(c), c, timeout)
            wait_healthy("kube-controller-manager",
                         lambda: (api.get("/api/v1/namespaces/default/serviceaccounts/default") is not None,
                                  "no default service account yet"), c, timeout)
        except BaseException:
            self.down()
            raise
        return self.handle()

    def _spawn(self, name: str, argv: list[str]) -> None:
        assert self.config is not None
        processes.spawn(name, argv, pid_dir=self.config.pid_dir,
                        log_path=self.config.log_dir / f"{name}.log")

    def _spawn_python(self, name: str, module: str) -> None:
        assert self.config is not None
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1")
        processes.spawn(name, [PYTHON, "-m", module, str(self.config.config_file)],
                        pid_dir=self.config.pid_dir, log_path=self.config.log_dir / f"{name}.log",
                        env=env, cwd=REPO_ROOT)

    # ---- stop ----------------------------------------------------------------------------
    def down(self) -> list[str]:
        """Stop everything and sweep leftovers; returns what could not be removed."""
        c = self.config
        if c is None:
            return []
        node = RealNode(c)
        for name in ("kube-proxy", "cluster-dns"):
            processes.stop(name, c.pid_dir, timeout=10.0)
        node.stop()  # kubelet, every pod, containerd, mounts, cgroups, the node's network
        remove_kube_proxy_chains()
        controlplane.stop(c)
        shutil.rmtree(c.state_dir / "etcd", ignore_errors=True)
        (c.state_dir / "owner").unlink(missing_ok=True)
        return self.leftovers()

    def prune_images(self) -> int:
        """Remove the node's image store (containerd's content and unpacked snapshots) while
        the cluster is down; returns the bytes freed. The image tarballs under
        $KUBESHARD_CACHE/images stay: the next start imports them again (a minute). `make
        test` calls this between the local suite and kind, which loads its own copy of the
        same images: the two copies together filled a CI machine's disk."""
        if self.is_running():
            raise RuntimeError(f"the local cluster of {self.state_dir} is running: `down` it first")
        store = containerd.root_dir(self.config) if self.config is not None else self.state_dir / "containerd"
        if not store.exists():
            return 0
        leftovers = self.down()
        if leftovers:
            raise RuntimeError("could not stop the local cluster entirely: " + ", ".join(leftovers))
        freed = sum(f.lstat().st_size for f in store.rglob("*") if f.is_file() and not f.is_symlink())
        shutil.rmtree(store)
        return freed

    def leftovers(self) -> list[str]:
        """Everything of this cluster still present on the machine (empty after `down`)."""
        c = self.config
        if c is None:
            return []
        found = RealNode(c).leftovers() + [f"iptables chain {x}" for x in kube_proxy_chains()]
        for name in controlplane.COMPONENTS + ADDONS:
            pid = processes.running(name, c.pid_dir)
            if pid is not None:
                found.append(f"{name} process {pid}")
        # Components whose pid files are gone: every one of ours names the state dir in
        # its arguments (other clusters built from the same binaries do not).
        marker = str(c.state_dir).encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            name = Path(argv[0].decode(errors="replace")).name if argv else ""
            if name in KUBE_BINARIES and any(marker in a for a in argv[1:]) \
                    and processes.start_time(int(entry.name)):
                found.append(f"{name} process {entry.name}")
        return list(dict.fromkeys(found))


def _preflight() -> None:
    if os.geteuid() != 0:
        raise StartupError("the local cluster needs root (containerd, the kubelet, nftables, iptables); "
                           "use KUBESHARD_E2E_KUBECONFIG to test against another cluster")
    missing = [t for t in ("ip", "nft", "iptables") if shutil.which(t) is None]
    if missing:
        raise StartupError(f"missing system tools: {', '.join(missing)} (run hack/ensure-system-deps.sh)")


def _kube_proxy_argv(c: ClusterConfig) -> list[str]:
    return [
        str(c.bin_dir / "kube-proxy"),
        f"--kubeconfig={c.component_kubeconfig('kube-proxy')}",
        # iptables, beside the NetworkPolicy engine's chains (iptables and ipset too).
        "--proxy-mode=iptables",
        f"--hostname-override={c.node_specs[0].name}",
        f"--cluster-cidr={c.cluster_cidr}",
        f"--healthz-bind-address=127.0.0.1:{c.kube_proxy_healthz_port}",
        f"--metrics-bind-address=127.0.0.1:{c.kube_proxy_metrics_port}",
        # Leave the host's conntrack sizes and timeouts alone, and route_localnet
        # off (NodePorts on 127.0.0.1 would need it, for every interface).
        "--conntrack-max-per-core=0",
        "--conntrack-tcp-timeout-established=0", "--conntrack-tcp-timeout-close-wait=0",
        "--iptables-localhost-nodeports=false",
    ]


def _kube_proxy_synced(c: ClusterConfig) -> tuple[bool, str]:
    status, body = controlplane._http_get(c.kube_proxy_healthz_port, "/healthz")
    if status != 200:
        return False, body
    # Healthy can precede the first sync; the Service rules exist once its chain does.
    chain = subprocess.run(["iptables", "-t", "nat", "-S", "KUBE-SERVICES"], capture_output=True,
                           text=True, timeout=10)
    return chain.returncode == 0, chain.stderr or "kube-proxy's KUBE-SERVICES chain exists"


def _create_dns_service(api: Api, c: ClusterConfig) -> None:
    """kube-system/kube-dns, as in every cluster; reserves the DNS IP and documents it.

    It has no selector: its endpoint is the DNS server on the node's address, and
    kube-proxy does the rest.
    """
    target = {"targetPort": c.dns_port}
    body = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "kube-dns", "namespace": "kube-system",
                     "labels": {"k8s-app": "kube-dns", "kubernetes.io/name": "CoreDNS"}},
        "spec": {"clusterIP": c.dns_service_ip, "ports": [
            {"name": "dns", "port": 53, "protocol": "UDP", **target},
            {"name": "dns-tcp", "port": 53, "protocol": "TCP", **target}]},
    }
    objects = [("/api/v1/namespaces/kube-system/services", body),
               ("/api/v1/namespaces/kube-system/endpoints", {
                   "apiVersion": "v1", "kind": "Endpoints",
                   "metadata": {"name": "kube-dns", "namespace": "kube-system"},
                   "subsets": [{"addresses": [{"ip": c.advertise_address}],
                                "ports": [{"name": "dns", "port": c.dns_port, "protocol": "UDP"},
                                          {"name": "dns-tcp", "port": c.dns_port, "protocol": "TCP"}]}],
               })]
    for path, obj in objects:
        try:
            api.create(path, obj)
        except ApiError as e:
            if e.status != 409:
                raise


def kube_proxy_chains() -> list[str]:
    """iptables chains of kube-proxy's iptables mode (table/chain), on this machine."""
    found = []
    for table in ("nat", "filter", "mangle"):
        out = subprocess.run(["iptables", "-t", table, "-S"], capture_output=True, text=True, timeout=30)
        found += [f"{table}/{line.split()[1]}" for line in out.stdout.splitlines()
                  if line.startswith("-N KUBE-") and not line.split()[1].startswith("KUBE-ROUTER")]
    return found


def remove_kube_proxy_chains() -> None:
    """Undo kube-proxy's iptables mode: the jumps from the built-in chains, then its chains.

    Done by hand rather than with `kube-proxy --cleanup`, which would also delete the
    nftables rules of any other kube-proxy on this machine."""
    for table in ("nat", "filter", "mangle"):
        rules = subprocess.run(["iptables", "-t", table, "-S"], capture_output=True, text=True,
                               timeout=30).stdout.splitlines()
        ours = {line.split()[1] for line in rules if line.startswith("-N KUBE-")
                and not line.split()[1].startswith("KUBE-ROUTER")}
        for line in rules:
            parts = shlex.split(line)  # comments are quoted
            if parts[0] == "-A" and parts[1] not in ours and "-j" in parts and \
                    parts[parts.index("-j") + 1] in ours:
                subprocess.run(["iptables", "-t", table, "-D", *parts[1:]], capture_output=True, timeout=30)
        for chain in ours:
            subprocess.run(["iptables", "-t", table, "-F", chain], capture_output=True, timeout=30)
        for chain in ours:
            subprocess.run(["iptables", "-t", table, "-X", chain], capture_output=True, timeout=30)


def _node_ready(api: Api, name: str) -> tuple[bool, str]:
    node = api.get(f"/api/v1/nodes/{name}")
    if node is None:
        return False, f"node {name} not registered"
    conds = {x["type"]: x["status"] for x in (node.get("status") or {}).get("conditions") or []}
    return conds.get("Ready") == "True", f"node {name} conditions {conds}"


def _dns_answers(c: ClusterConfig) -> tuple[bool, str]:
    q = DNSRecord.question("kubernetes.default.svc.cluster.local")
    try:
        reply = DNSRecord.parse(q.send("127.0.0.1", c.dns_port, timeout=1.0))
    except (socket.timeout, OSError) as e:
        return False, str(e)
    answers = [str(r.rdata) for r in reply.rr]
    return c.kubernetes_service_ip in answers, f"answers {answers}"


def summary(cluster: LocalCluster) -> dict:
    c = cluster.config
    if c is None:
        return {"running": False}
    pids = {n: processes.running(n, c.pid_dir) for n in controlplane.COMPONENTS + ADDONS}
    return {"running": cluster.is_running(), "kubeconfig": str(c.kubeconfig), "pids": pids,
            "apiserver": c.apiserver_url, "nodes": [n.name for n in c.node_specs]}


def dumps(obj) -> str:
    return json.dumps(obj, indent=2, default=str)
