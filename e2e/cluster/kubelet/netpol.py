"""NetworkPolicy on the real node: kube-router's network-policy controller, firewall only.

kube-router (built by hack/node-tools.sh) runs on the host as `system:kube-router` with
the read access its controller needs, watches Pods, Namespaces and NetworkPolicies, and
turns them into iptables chains (KUBE-ROUTER-*, KUBE-POD-FW-*, KUBE-NWPLCY-*) and ipsets
that every routed pod packet crosses (pods are routed, CNI ptp: no bridge to bypass).
As in kube-router's own deployments, traffic from the node itself (the kubelet's
probes, the host) is always allowed. Its pod routing, BGP and service proxy stay off
(the ptp plugin and kube-proxy do those jobs).
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from ..config import ClusterConfig

CLUSTER_ROLE = {
    "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
    "metadata": {"name": "system:kube-router"},
    "rules": [
        {"apiGroups": [""], "resources": ["namespaces", "pods", "services", "nodes", "endpoints"],
         "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"],
         "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
         "verbs": ["get", "list", "watch"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
    ],
}
BINDING = {
    "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
    "metadata": {"name": "system:kube-router"},
    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:kube-router"},
    "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "system:kube-router"}],
}
CHAIN_PREFIXES = ("KUBE-ROUTER-", "KUBE-POD-FW-", "KUBE-NWPLCY-")


def rbac_objects() -> list[tuple[str, dict]]:
    return [("/apis/rbac.authorization.k8s.io/v1/clusterroles", CLUSTER_ROLE),
            ("/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", BINDING)]


def argv(c: ClusterConfig, kube_router: Path) -> list[str]:
    return [
        str(kube_router),
        f"--kubeconfig={c.component_kubeconfig('kube-router')}",
        f"--hostname-override={c.node_specs[0].name}",
        "--run-firewall=true", "--run-router=false", "--run-service-proxy=false",
        "--enable-cni=false", "--enable-ipv4=true", "--enable-ipv6=false",
        "--enable-pod-egress=false",
        f"--service-cluster-ip-range={c.service_cidr}",
        f"--health-port={c.netpol_healthz_port}", "--metrics-port=0",
        "--iptables-sync-period=1m",
        "--v=1",
    ]


def chains() -> list[str]:
    found = []
    for table in ("filter", "nat", "mangle"):
        out = subprocess.run(["iptables", "-t", table, "-S"], capture_output=True, text=True, timeout=30)
        found += [f"{table}/{line.split()[1]}" for line in out.stdout.splitlines()
                  if line.startswith("-N ") and line.split()[1].startswith(CHAIN_PREFIXES)]
    return found


def ipsets() -> list[str]:
    out = subprocess.run(["ipset", "list", "-n"], capture_output=True, text=True, timeout=30)
    return [n for n in out.stdout.split() if n.startswith(("KUBE-", "kube-router"))]


def cleanup() -> None:
    """kube-router's chains (jumps from the built-in chains first) and its ipsets."""
    for table in ("filter", "nat", "mangle"):
        rules = subprocess.run(["iptables", "-t", table, "-S"], capture_output=True, text=True,
                               timeout=30).stdout.splitlines()
        ours = {line.split()[1] for line in rules if line.startswith("-N ")
                and line.split()[1].startswith(CHAIN_PREFIXES)}
        for line in rules:
            parts = shlex.split(line)
            if parts and parts[0] == "-A" and parts[1] not in ours and "-j" in parts \
                    and parts[parts.index("-j") + 1] in ours:
                subprocess.run(["iptables", "-t", table, "-D", *parts[1:]], capture_output=True, timeout=30)
        for action in ("-F", "-X"):
            for chain in ours:
                subprocess.run(["iptables", "-t", table, action, chain], capture_output=True, timeout=30)
    for name in ipsets():
        subprocess.run(["ipset", "destroy", name], capture_output=True, timeout=30)
