"""The local cluster's pure parts, without a cluster: image map, env, DNS, status, waiting."""

from __future__ import annotations

from pathlib import Path

import pytest
from dnslib import RCODE, DNSRecord

from e2e.cluster.dns import ClusterIndex, ClusterResolver
from e2e.cluster.node import env, images
from e2e.cluster.node.container import Container
from e2e.cluster.node.status import phase
from e2e.cluster.node.volumes import Mountpoints
from e2e.waiting import wait_for


def test_image_map_follows_kubernetes_command_and_args_rules(tmp_path: Path):
    shard = images.resolve("ghcr.io/kubeshard/shard-server:0.1.0", tmp_path)
    assert shard.argv(None, None) == [str(images.VENV_BIN / "kubeshard"), "serve-shard"]
    assert shard.argv(None, ["serve-shard", "--port", "1"])[1:] == ["serve-shard", "--port", "1"]
    assert shard.argv(["python", "-m", "x"], None) == ["python", "-m", "x"]  # command drops default args
    assert shard.argv(["sh", "-c"], ["echo"]) == ["sh", "-c", "echo"]
    assert images.resolve("localhost:5000/kubeshard/router@sha256:abc", tmp_path).entrypoint[0].endswith(
        "kubeshard-router")
    assert images.resolve("kubeshard/operator", tmp_path).argv(None, None)[0].endswith("kubeshard-operator")
    py = images.resolve("python:3.11-slim", tmp_path)
    assert py.argv(None, None) == ["python3"] and py.path[0] == str(images.VENV_BIN)
    with pytest.raises(images.ImageNotFound, match='"python:2.7"'):
        images.resolve("python:2.7", tmp_path)
    with pytest.raises(images.ImageNotFound, match="nginx:1.27"):
        images.resolve("docker.io/library/nginx:1.27", tmp_path)


def test_redis_image_behaves_like_the_official_entrypoint(tmp_path: Path):
    redis = images.resolve("docker.io/library/redis:7.4", tmp_path)
    assert redis.argv(None, None) == ["redis-server", "--protected-mode", "no"]
    assert redis.argv(None, ["--appendonly", "yes"]) == ["redis-server", "--appendonly", "yes",
                                                          "--protected-mode", "no"]
    assert redis.argv(None, ["/etc/redis.conf"]) == ["redis-server", "/etc/redis.conf"]
    assert redis.argv(["redis-server", "--port", "7"], None) == ["redis-server", "--port", "7"]


def test_env_expansion_and_service_links():
    assert env.expand("$(A)-$(B)-$$(A)-$(MISSING)", {"A": "1", "B": "2"}) == "1-2-$(A)-$(MISSING)"
    links = env.service_links([{"metadata": {"name": "my-db"}, "spec": {
        "clusterIP": "10.96.0.7", "ports": [{"name": "pg", "port": 5432, "protocol": "TCP"}]}}], None)
    assert links["MY_DB_SERVICE_HOST"] == "10.96.0.7"
    assert links["MY_DB_SERVICE_PORT"] == links["MY_DB_SERVICE_PORT_PG"] == "5432"
    assert links["MY_DB_PORT_5432_TCP_ADDR"] == "10.96.0.7"
    headless = env.service_links([{"metadata": {"name": "h"}, "spec": {"clusterIP": "None", "ports": [
        {"port": 1}]}}], None)
    assert headless == {}


def _dns(index: ClusterIndex, name: str, qtype: str = "A") -> DNSRecord:
    return ClusterResolver(index).resolve(DNSRecord.question(name, qtype), None)


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


def test_pod_phase_follows_containers_and_restart_policy():
    def container(done=False, code=None, running=False, init=False):
        c = Container({"name": "c", "image": "busybox"}, init)
        c.done = done
        if code is not None or running:
            c.run = type("Run", (), {"exit_code": None if running else code})()
        return c

    assert phase([], [container()], failed_init=False, started=False) == "Pending"
    assert phase([container(init=True)], [container()], failed_init=False, started=True) == "Pending"
    assert phase([], [container(running=True)], failed_init=False, started=True) == "Running"
    assert phase([], [container(done=True, code=0)], failed_init=False, started=True) == "Succeeded"
    assert phase([], [container(done=True, code=0), container(done=True, code=2)], False, True) == "Failed"
    assert phase([], [container(done=True, code=0), container(running=True)], False, True) == "Running"
    assert phase([container(done=True, code=1, init=True)], [container()], True, True) == "Failed"


def test_mountpoints_are_created_shared_and_removed(tmp_path: Path):
    mp = Mountpoints(tmp_path / "record")
    target = tmp_path / "a" / "b" / "c"
    first = mp.ensure(str(target), is_dir=True)
    second = mp.ensure(str(target), is_dir=True)
    assert target.is_dir()
    mp.release([first])
    assert target.is_dir(), "removed while another pod still mounts it"
    mp.release([second])
    assert not (tmp_path / "a").exists()
    existing = tmp_path / "kept"
    existing.mkdir()
    mp.release([mp.ensure(str(existing), is_dir=True)])
    assert existing.is_dir(), "removed a folder it did not create"


def test_wait_for_reports_what_it_last_saw():
    assert wait_for(lambda: 7, timeout=1) == 7
    with pytest.raises(AssertionError, match=r"waiting for the answer; last value: 0"):
        wait_for(lambda: 0, timeout=0.2, interval=0.05, what="the answer")

    def boom():
        raise RuntimeError("not yet")

    with pytest.raises(AssertionError, match="last exception: RuntimeError: not yet"):
        wait_for(boom, timeout=0.2, interval=0.05)
