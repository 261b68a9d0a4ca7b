"""The host side of the real node's pod network: routed pods (CNI ptp), no bridge.

Every pod gets a veth pair from the CNI `ptp` plugin: the pod's end holds its IP from
the node's pod CIDR, the host's end holds the node's address (10.244.N.1/32) and a /32
route to the pod. All pod traffic is routed by the host, so kube-proxy's Service NAT and
the NetworkPolicy engine's iptables rules see every packet (no br_netfilter needed, which
this kernel lacks). The node's address also sits on an interface of its own (a bridge
with no ports: this kernel has no dummy driver), so the kubelet,
the API server's advertised address and the cluster DNS exist before the first pod.

The nft table `ip kubeshard-node<i>` keeps everything on the machine:

* forward: a packet from a pod may only go to a pod, and only pods' packets reach pods,
  so nothing a pod sends leaves the machine and nothing from outside reaches a pod;
* input: the control plane's ports answer on the node's address only to pods and the
  host itself.

The ptp plugin switches on IPv4 forwarding and the kubelet sets its kernel tunables
(vm.overcommit_memory, kernel.panic, kernel.panic_on_oops); `setup` records the
host's values and `teardown` puts them back. (The cluster's ports lie below the
kernel's ephemeral range, so no outgoing connection holds one: see ClusterConfig.)
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from ..config import ClusterConfig

SYSCTLS = ("net/ipv4/ip_forward", "vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic",
           "kernel/panic_on_oops", "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes")
CNI_NETWORK = "kubeshard"


class NetworkError(RuntimeError):
    pass


def node_interface(c: ClusterConfig) -> str:
    return f"ksnode{c.instance}"


def nft_table(c: ClusterConfig) -> str:
    return f"kubeshard-node{c.instance}"


def _run(*argv: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, input=input, text=True, capture_output=True, timeout=30)
    if check and proc.returncode != 0:
        raise NetworkError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _saved_sysctls(c: ClusterConfig) -> Path:
    return c.state_dir / "host-sysctls.json"


def _nft_rules(c: ClusterConfig) -> str:
    cidr = c.cluster_cidr
    ports = ", ".join(str(p) for p in (c.apiserver_port, c.dns_port, c.kubelet_port, c.netpol_healthz_port))
    node_ips = ", ".join(n.gateway for n in c.node_specs)
    return f"""
table ip {nft_table(c)} {{
  chain forward {{
    type filter hook forward priority -5; policy accept;
    ip saddr {cidr} ip daddr != {cidr} drop
    ip daddr {cidr} ip saddr != {cidr} drop
  }}
  chain input {{
    type filter hook input priority -5; policy accept;
    iifname "lo" accept
    ip daddr != {{ {node_ips} }} tcp dport {{ {ports} }} drop
    ip daddr != {{ {node_ips} }} udp dport {c.dns_port} drop
    ip saddr != {cidr} ip daddr {{ {node_ips} }} drop
  }}
}}
"""


def cni_config(c: ClusterConfig, node_index: int = 0) -> dict:
    node = c.node_specs[node_index]
    return {
        "cniVersion": "1.0.0",
        "name": CNI_NETWORK,
        "plugins": [
            {
                "type": "ptp",
                "mtu": 1500,
                "ipMasq": False,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": node.pod_cidr, "gateway": node.gateway}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(c.state_dir / "cni" / "ipam"),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def write_cni_config(c: ClusterConfig) -> Path:
    conf_dir = c.state_dir / "cni" / "net.d"
    conf_dir.mkdir(parents=True, exist_ok=True)
    (conf_dir / "10-kubeshard.conflist").write_text(json.dumps(cni_config(c), indent=2))
    return conf_dir


def setup(c: ClusterConfig) -> None:
    teardown(c)
    saved = {k: Path("/proc/sys", k).read_text().strip() for k in SYSCTLS}
    _saved_sysctls(c).write_text(json.dumps(saved))
    dev = node_interface(c)
    # A bridge without ports holds the addresses (this kernel has no dummy driver).
    _run("ip", "link", "add", dev, "type", "bridge")
    for node in c.node_specs:
        _run("ip", "addr", "add", f"{node.gateway}/32", "dev", dev)
    _run("ip", "link", "set", dev, "up")
    # Service IPs are virtual: the host's own connections to them are DNAT'd by
    # kube-proxy on output; one that is not (no such Service) ends on the node's
    # interface instead of following the default route off the machine.
    _run("ip", "route", "add", c.service_cidr, "dev", dev)
    _run("ip", "route", "add", "unreachable", c.cluster_cidr)
    _run("nft", "-f", "-", input=_nft_rules(c))
    write_cni_config(c)


def pod_veths(c: ClusterConfig) -> list[str]:
    """Host ends of pod veths: the interfaces other than the node's own holding its address."""
    out = _run("ip", "-o", "-4", "addr", "show", check=False).stdout
    gateways = {n.gateway for n in c.node_specs}
    found = []
    for line in out.splitlines():
        fields = line.split()
        if len(fields) > 3 and fields[3].split("/")[0] in gateways:
            name = fields[1].split("@")[0]
            if name != node_interface(c):
                found.append(name)
    return sorted(set(found))


def teardown(c: ClusterConfig) -> None:
    """Remove what `setup` and the CNI plugin made, and restore the host's sysctls."""
    for veth in pod_veths(c):
        _run("ip", "link", "del", veth, check=False)
    _run("nft", "delete", "table", "ip", nft_table(c), check=False)
    _run("ip", "route", "del", "unreachable", c.cluster_cidr, check=False)
    _run("ip", "route", "del", c.service_cidr, check=False)
    _run("ip", "link", "del", node_interface(c), check=False)
    saved = _saved_sysctls(c)
    if saved.exists():
        for key, value in json.loads(saved.read_text()).items():
            try:
                Path("/proc/sys", key).write_text(value + "\n")  # "" alone would write nothing
            except OSError:
                pass
        saved.unlink()


def leftovers(c: ClusterConfig) -> list[str]:
    found = [f"veth {v}" for v in pod_veths(c)]
    if _run("ip", "link", "show", node_interface(c), check=False).returncode == 0:
        found.append(f"interface {node_interface(c)}")
    if f"table ip {nft_table(c)}" in _run("nft", "list", "tables", check=False).stdout:
        found.append(f"table ip {nft_table(c)}")
    routes = _run("ip", "route", "show", check=False).stdout
    for cidr in (c.cluster_cidr, c.service_cidr):
        if cidr in routes:
            found.append(f"route {cidr}")
    return found
