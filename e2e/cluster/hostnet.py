"""The host side of the pod network: one bridge, the node gateways, and a small nft table.

Pods sit on bridge `ksbr0`, each node's gateway address (10.244.N.1) is on it, and the
Service CIDR is routed onto it so the host's own connections to Service IPs get
kube-proxy's DNAT. The nft table `ip kubeshard` does two jobs a real node's network
would do differently:

* it DNATs the `kubernetes` Service (and the API server's advertised address) and the
  cluster DNS Service to the API server and DNS server, which listen on 127.0.0.1 only;
  it runs before kube-proxy's NAT chains (priority -110 < -100), and the first DNAT wins;
* it drops any forwarded packet from the bridge to another interface, so nothing a pod
  sends ever leaves the machine (pods also have no default route).

Everything here is undone by `teardown`, which is safe to run any number of times.
"""

from __future__ import annotations

import subprocess

from .config import BRIDGE, NFT_TABLE, VETH_PREFIX, ClusterConfig


class NetworkError(RuntimeError):
    pass


def _run(*argv: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, input=input, text=True, capture_output=True, timeout=30)
    if check and proc.returncode != 0:
        raise NetworkError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _sysctl(key: str, value: str) -> None:
    with open("/proc/sys/" + key.replace(".", "/"), "w") as f:
        f.write(value)


def _nft_rules(config: ClusterConfig) -> str:
    api = f"127.0.0.1:{config.apiserver_port}"
    dns = f"127.0.0.1:{config.dns_port}"
    svc_api, svc_dns = config.kubernetes_service_ip, config.dns_service_ip
    adv = config.advertise_address
    to_api = [
        f"ip daddr {svc_api} tcp dport 443 dnat to {api}",
        f"ip daddr {adv} tcp dport {config.apiserver_port} dnat to {api}",
    ]
    to_dns = [
        f"ip daddr {svc_dns} udp dport 53 dnat to {dns}",
        f"ip daddr {svc_dns} tcp dport 53 dnat to {dns}",
    ]
    pre = "\n".join(f'    iifname "{BRIDGE}" {r}' for r in to_api + to_dns)
    out = "\n".join(f"    {r}" for r in to_api + to_dns)
    return f"""
table ip {NFT_TABLE} {{
  chain prerouting {{
    type nat hook prerouting priority -110; policy accept;
{pre}
  }}
  chain output {{
    type nat hook output priority -110; policy accept;
{out}
  }}
  chain forward {{
    type filter hook forward priority -10; policy accept;
    iifname "{BRIDGE}" oifname != "{BRIDGE}" drop
    oifname "{BRIDGE}" iifname != "{BRIDGE}" drop
  }}
}}
"""


def setup(config: ClusterConfig) -> None:
    teardown(config)
    _run("ip", "link", "add", BRIDGE, "type", "bridge")
    for node in config.node_specs:
        prefix = node.pod_cidr.split("/")[1]
        _run("ip", "addr", "add", f"{node.gateway}/{prefix}", "dev", BRIDGE)
    _run("ip", "link", "set", BRIDGE, "up")
    # Packets from pods may be routed (pod -> Service IP -> pod on the same bridge), and
    # may be DNAT'd to 127.0.0.1; both only for packets arriving on the bridge.
    _sysctl(f"net.ipv4.conf.{BRIDGE}.forwarding", "1")
    _sysctl(f"net.ipv4.conf.{BRIDGE}.route_localnet", "1")
    # Service IPs are virtual: route them onto the bridge so kube-proxy's output DNAT
    # sees the host's connections; an unused pod range fails here instead of following
    # the default route off the machine.
    _run("ip", "route", "add", config.service_cidr, "dev", BRIDGE)
    _run("ip", "route", "add", "unreachable", config.cluster_cidr)
    _run("nft", "-f", "-", input=_nft_rules(config))


def pod_veths() -> list[str]:
    """Host ends of pod veth pairs (named ksv<hash> by node/network.py)."""
    out = _run("ip", "-o", "link", "show", check=False).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]
    return [n for n in names if n.startswith(VETH_PREFIX)]


def teardown(config: ClusterConfig) -> None:
    """Remove the bridge, routes and nft tables (ours and kube-proxy's) and pod veths."""
    # The kernel destroys a dead sandbox's namespace (and its veth) asynchronously;
    # deleting the host end removes the pair at once.
    for veth in pod_veths():
        _run("ip", "link", "del", veth, check=False)
    for family, table in (("ip", NFT_TABLE), ("ip", "kube-proxy"), ("ip6", "kube-proxy")):
        _run("nft", "delete", "table", family, table, check=False)
    _run("ip", "route", "del", "unreachable", config.cluster_cidr, check=False)
    _run("ip", "route", "del", config.service_cidr, check=False)
    _run("ip", "link", "del", BRIDGE, check=False)


def leftovers(config: ClusterConfig) -> list[str]:
    """What `teardown` would remove that still exists (for tests and `status`)."""
    found = []
    if _run("ip", "link", "show", BRIDGE, check=False).returncode == 0:
        found.append(f"bridge {BRIDGE}")
    found += [f"veth {v}" for v in pod_veths()]
    tables = _run("nft", "list", "tables", check=False).stdout
    for line in tables.splitlines():
        if line.strip() in (f"table ip {NFT_TABLE}", "table ip kube-proxy", "table ip6 kube-proxy"):
            found.append(line.strip())
    routes = _run("ip", "route", "show", check=False).stdout
    for cidr in (config.cluster_cidr, config.service_cidr):
        if cidr in routes:
            found.append(f"route {cidr}")
    return found
