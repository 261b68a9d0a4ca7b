"""The local cluster's pure parts, without a cluster: its ports, cluster DNS, waiting."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from dnslib import RCODE, DNSRecord

from e2e.cluster.config import ClusterConfig
from e2e.cluster.dns import ClusterIndex, ClusterResolver
from e2e.waiting import wait_for


def _dns(index: ClusterIndex, name: str, qtype: str = "A") -> DNSRecord:
    return ClusterResolver(index).resolve(DNSRecord.question(name, qtype), None)


def test_cluster_ports_lie_outside_the_kernels_ephemeral_range():
    # An outgoing connection may take any ephemeral port as its local end; a cluster port
    # there made the cluster's start fail at random ("in use, unknown owner").
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    for instance in range(4):
        c = ClusterConfig.for_instance(instance, state_dir=Path("/x"), bin_dir=Path("/x"))
        ports = {f.name: getattr(c, f.name) for f in dataclasses.fields(c) if f.name.endswith("_port")}
        inside = {name: port for name, port in ports.items() if low <= port <= high}
        assert not inside, f"instance {instance}: {inside} in the ephemeral range {low}-{high}"
        assert len(set(ports.values())) == len(ports), ports


def test_dns_answers_services_headless_hostnames_and_srv():
    index = ClusterIndex()
    index.on_service("SYNC", [
        {"metadata": {"namespace": "ns", "name": "api"},
         "spec": {"clusterIP": "10.96.3.4", "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]}},
        {"metadata": {"namespace": "ns", "name": "web"},
         "spec": {"clusterIP": "None", "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]}},
    ])
    index.on_slice("SYNC", [{
        "metadata": {"namespace": "ns", "name": "web-abc", "labels": {"kubernetes.io/service-name": "web"}},
        "addressType": "IPv4", "ports": [{"name": "http", "port": 8080}],
        "endpoints": [
            {"addresses": ["10.244.0.5"], "hostname": "web-0", "conditions": {"ready": True}},
            {"addresses": ["10.244.0.6"], "hostname": "web-1", "conditions": {"ready": False}},
        ],
    }])
    ips = lambda r: sorted(str(x.rdata) for x in r.rr)  # noqa: E731
    assert ips(_dns(index, "api.ns.svc.cluster.local")) == ["10.96.3.4"]
    assert ips(_dns(index, "web.ns.svc.cluster.local")) == ["10.244.0.5"]  # ready endpoints only
    assert ips(_dns(index, "web-0.web.ns.svc.cluster.local")) == ["10.244.0.5"]
    assert _dns(index, "web-1.web.ns.svc.cluster.local").header.rcode == RCODE.NXDOMAIN
    srv = _dns(index, "_http._tcp.web.ns.svc.cluster.local", "SRV").rr
    assert [(r.rdata.port, str(r.rdata.target)) for r in srv] == [(8080, "web-0.web.ns.svc.cluster.local.")]
    nodata = _dns(index, "api.ns.svc.cluster.local", "AAAA")
    assert nodata.header.rcode == RCODE.NOERROR and not nodata.rr  # glibc needs NODATA, not NXDOMAIN
    assert ips(_dns(index, "10-244-0-9.ns.pod.cluster.local")) == ["10.244.0.9"]
    for name in ("nope.ns.svc.cluster.local", "example.com", "api.other.svc.cluster.local"):
        assert _dns(index, name).header.rcode == RCODE.NXDOMAIN, name


def test_wait_for_reports_what_it_last_saw():
    assert wait_for(lambda: 7, timeout=1) == 7
    with pytest.raises(AssertionError, match=r"waiting for the answer; last value: 0"):
        wait_for(lambda: 0, timeout=0.2, interval=0.05, what="the answer")

    def boom():
        raise RuntimeError("not yet")

    with pytest.raises(AssertionError, match="last exception: RuntimeError: not yet"):
        wait_for(boom, timeout=0.2, interval=0.05)


def test_prune_removes_only_the_node_image_store(tmp_path: Path):
    from e2e.cluster.local import LocalCluster

    blob = tmp_path / "containerd" / "root" / "io.containerd.content.v1.content" / "blobs" / "sha256" / "ab"
    blob.parent.mkdir(parents=True)
    blob.write_bytes(b"x" * 1000)
    (blob.parent / "link").symlink_to("/etc/hostname")
    kept = tmp_path / "pki" / "ca.crt"
    kept.parent.mkdir()
    kept.write_text("certificate")
    cluster = LocalCluster(tmp_path)
    assert cluster.prune_images() == 1000
    assert not (tmp_path / "containerd").exists()
    assert kept.read_text() == "certificate"
    assert cluster.prune_images() == 0
