"""The files the kubelet writes for each pod: /etc/hosts, /etc/hostname, /etc/resolv.conf.

resolv.conf follows dnsPolicy (ClusterFirst: the cluster DNS with the namespace search
path and ndots:5; Default: the node's file; None: only dnsConfig) plus dnsConfig.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import CLUSTER_DOMAIN


def write(pod: dict[str, Any], etc: Path, ip: str, dns_ip: str) -> None:
    """Write hosts, hostname and (unless the node's file is to be used) resolv.conf."""
    spec = pod["spec"]
    ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
    etc.mkdir(parents=True, exist_ok=True)
    hostname = spec.get("hostname") or name
    names = [hostname]
    if spec.get("subdomain"):
        names.insert(0, f"{hostname}.{spec['subdomain']}.{ns}.svc.{CLUSTER_DOMAIN}")
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
             f"{ip}\t{' '.join(names)}"]
    for alias in spec.get("hostAliases") or []:
        lines.append(f"{alias['ip']}\t{' '.join(alias.get('hostnames') or [])}")
    (etc / "hosts").write_text("\n".join(lines) + "\n")
    (etc / "hostname").write_text(hostname + "\n")
    policy = spec.get("dnsPolicy", "ClusterFirst")
    if spec.get("hostNetwork") and policy == "ClusterFirst":
        policy = "Default"  # as in Kubernetes: host-network pods keep the node's DNS
    dns_config = spec.get("dnsConfig") or {}
    servers: list[str] = []
    searches: list[str] = []
    options = ["ndots:5"]
    if policy in ("ClusterFirst", "ClusterFirstWithHostNet"):
        servers = [dns_ip]
        searches = [f"{ns}.svc.{CLUSTER_DOMAIN}", f"svc.{CLUSTER_DOMAIN}", CLUSTER_DOMAIN]
    elif policy == "None":
        options = []
    if policy == "Default":
        return
    servers += dns_config.get("nameservers") or []
    searches += dns_config.get("searches") or []
    for opt in dns_config.get("options") or []:
        options.append(opt["name"] + (f":{opt['value']}" if opt.get("value") else ""))
    text = "".join(f"nameserver {s}\n" for s in servers)
    if searches:
        text += f"search {' '.join(searches)}\n"
    if options:
        text += f"options {' '.join(options)}\n"
    (etc / "resolv.conf").write_text(text)
