"""etcd, kube-apiserver, kube-controller-manager and kube-scheduler as local processes.

Flags follow kubeadm's static pods, with every listener on 127.0.0.1 and the ports of
ClusterConfig (not the well-known ones, so the harness does not collide with anything
else on a developer's machine).
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import subprocess
import time
from . import processes
from .certs import Pki
from .config import ClusterConfig
from .kubeconfig import write_kubeconfig

COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")


class StartupError(RuntimeError):
    pass


def _etcd(c: ClusterConfig) -> list[str]:
    client = f"http://127.0.0.1:{c.etcd_client_port}"
    peer = f"http://127.0.0.1:{c.etcd_peer_port}"
    return [
        str(c.bin_dir / "etcd"), "--name=default", f"--data-dir={c.state_dir / 'etcd'}",
        f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=default={peer}", "--initial-cluster-state=new",
        # A test cluster is thrown away: skip fsync, the slowest part of every write.
        "--unsafe-no-fsync", "--log-level=warn",
    ]


def _apiserver(c: ClusterConfig, pki: Pki) -> list[str]:
    return [
        str(c.bin_dir / "kube-apiserver"),
        f"--etcd-servers=http://127.0.0.1:{c.etcd_client_port}",
        # Pods reach the API at the advertised address, the node's: the API server
        # listens on it too (the node's nft table admits only pods and the host).
        "--bind-address=0.0.0.0",
        f"--secure-port={c.apiserver_port}",
        f"--advertise-address={c.advertise_address}",
        f"--service-cluster-ip-range={c.service_cidr}",
        f"--tls-cert-file={pki.apiserver.cert}", f"--tls-private-key-file={pki.apiserver.key}",
        f"--client-ca-file={pki.ca.cert}",
        "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
        "--allow-privileged=true",
        f"--service-account-key-file={pki.sa_pub}",
        f"--service-account-signing-key-file={pki.sa_key}",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        # The aggregation layer: the API server proxies APIService requests with this
        # client certificate, and backends trust it through the requestheader CA.
        f"--requestheader-client-ca-file={pki.front_proxy_ca.cert}",
        "--requestheader-allowed-names=front-proxy-client",
        "--requestheader-username-headers=X-Remote-User",
        "--requestheader-group-headers=X-Remote-Group",
        "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        f"--proxy-client-cert-file={pki.front_proxy_client.cert}",
        f"--proxy-client-key-file={pki.front_proxy_client.key}",
        # Send APIService traffic to endpoint (pod) IPs, which the host reaches directly.
        "--enable-aggregator-routing=true",
        f"--kubelet-client-certificate={pki.apiserver_kubelet_client.cert}",
        f"--kubelet-client-key={pki.apiserver_kubelet_client.key}",
        f"--kubelet-certificate-authority={pki.ca.cert}",
        "--kubelet-preferred-address-types=InternalIP",
        "--profiling=false",
    ]


def _component(c: ClusterConfig, name: str, port: int) -> list[str]:
    """What kube-controller-manager and kube-scheduler share: their binary, their
    kubeconfig for the API and for delegated authn/authz, a loopback secure port, no
    leader election (one of each)."""
    kc = c.component_kubeconfig(name)
    return [
        str(c.bin_dir / f"kube-{name}"),
        f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
        "--bind-address=127.0.0.1", f"--secure-port={port}", "--leader-elect=false", "--profiling=false",
    ]


def _controller_manager(c: ClusterConfig, pki: Pki) -> list[str]:
    return [
        *_component(c, "controller-manager", c.controller_manager_port),
        "--controllers=*",
        # Each controller acts as its own service account, so RBAC is exercised as in a
        # real cluster.
        "--use-service-account-credentials=true",
        f"--service-account-private-key-file={pki.sa_key}",
        f"--root-ca-file={pki.ca.cert}",
        f"--cluster-signing-cert-file={pki.ca.cert}", f"--cluster-signing-key-file={pki.ca.key}",
        f"--requestheader-client-ca-file={pki.front_proxy_ca.cert}",
        f"--client-ca-file={pki.ca.cert}",
        f"--service-cluster-ip-range={c.service_cidr}", f"--cluster-cidr={c.cluster_cidr}",
        # The kubelet's spec.podCIDR comes from here (node i gets the i-th /24 of the
        # cluster CIDR, as node_specs computes).
        "--allocate-node-cidrs=true", "--node-cidr-mask-size=24",
        "--configure-cloud-routes=false",
        "--horizontal-pod-autoscaler-sync-period=5s",
        "--node-monitor-period=5s",
    ]


def _scheduler(c: ClusterConfig) -> list[str]:
    return _component(c, "scheduler", c.scheduler_port)


def write_kubeconfigs(c: ClusterConfig, pki: Pki) -> None:
    ca = pki.ca.cert
    write_kubeconfig(c.kubeconfig, c.apiserver_url, ca, pki.clients["admin"], "kubernetes-admin")
    names = [("controller-manager", "system:kube-controller-manager"),
             ("scheduler", "system:kube-scheduler"), ("kube-proxy", "system:kube-proxy"),
             ("kube-router", "system:kube-router")]
    for name, user in names:
        write_kubeconfig(c.component_kubeconfig(name), c.apiserver_url, ca, pki.clients[name], user)
    for node in c.node_specs:
        write_kubeconfig(c.component_kubeconfig(f"node-{node.name}"), c.apiserver_url, ca,
                         pki.clients[f"node-{node.name}"], f"system:node:{node.name}")


def _https_get(port: int, path: str, pki: Pki | None, timeout: float = 3.0) -> tuple[int, str]:
    ctx = ssl.create_default_context()
    if pki is None:  # components' self-signed serving certs: only liveness matters here
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    else:
        ctx.load_verify_locations(pki.ca.cert)
        ctx.load_cert_chain(pki.clients["admin"].cert, pki.clients["admin"].key)
    return _get(http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=timeout), path)


def _http_get(port: int, path: str, timeout: float = 3.0) -> tuple[int, str]:
    return _get(http.client.HTTPConnection("127.0.0.1", port, timeout=timeout), path)


def _get(conn: http.client.HTTPConnection, path: str) -> tuple[int, str]:
    """(status, body) of one GET on ``conn``, which it closes."""
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


def wait_healthy(name: str, check, c: ClusterConfig, timeout: float) -> None:
    """Poll `check()` until it returns True; fail naming the component and its log tail."""
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    while time.monotonic() < deadline:
        if processes.running(name, c.pid_dir) is None:
            raise StartupError(f"{name} exited during startup:\n{log_tail(c, name)}")
        try:
            ok, last = check()
            if ok:
                return
        except (OSError, http.client.HTTPException) as e:
            last = f"{type(e).__name__}: {e}"
        time.sleep(0.25)
    raise StartupError(f"{name} not healthy after {timeout:.0f} s (last: {last[:500]}):\n{log_tail(c, name)}")


def log_tail(c: ClusterConfig, name: str, lines: int = 30) -> str:
    try:
        return "\n".join((c.log_dir / f"{name}.log").read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def ensure_ports_free(c: ClusterConfig) -> None:
    """Fail before starting anything if another program holds one of our ports."""
    ports = {"etcd": c.etcd_client_port, "etcd peer": c.etcd_peer_port,
             "kube-apiserver": c.apiserver_port, "kube-controller-manager": c.controller_manager_port,
             "kube-scheduler": c.scheduler_port, "kube-proxy healthz": c.kube_proxy_healthz_port,
             "kube-proxy metrics": c.kube_proxy_metrics_port, "cluster DNS": c.dns_port}
    busy = []
    for what, port in ports.items():
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                owner = subprocess.run(["ss", "-Hltnp", f"sport = :{port}"], capture_output=True,
                                       text=True, timeout=10).stdout.strip()
                busy.append(f"{what} port 127.0.0.1:{port} is in use ({owner or 'unknown owner'})")
    if busy:
        raise StartupError("cannot start the local cluster: " + "; ".join(busy))


def start(c: ClusterConfig, pki: Pki, timeout: float = 120.0) -> None:
    ensure_ports_free(c)
    write_kubeconfigs(c, pki)

    def spawn(name: str, argv: list[str]) -> None:
        processes.spawn(name, argv, pid_dir=c.pid_dir, log_path=c.log_dir / f"{name}.log")

    spawn("etcd", _etcd(c))

    def etcd_ok():
        status, body = _http_get(c.etcd_client_port, "/health")
        return status == 200 and json.loads(body).get("health") == "true", body

    wait_healthy("etcd", etcd_ok, c, timeout)

    spawn("kube-apiserver", _apiserver(c, pki))

    def api_ok():
        status, body = _https_get(c.apiserver_port, "/readyz", pki)
        return status == 200, body

    wait_healthy("kube-apiserver", api_ok, c, timeout)

    spawn("kube-controller-manager", _controller_manager(c, pki))
    spawn("kube-scheduler", _scheduler(c))
    for name, port in (("kube-controller-manager", c.controller_manager_port),
                       ("kube-scheduler", c.scheduler_port)):
        wait_healthy(name, lambda p=port: (lambda r: (r[0] == 200, r[1]))(_https_get(p, "/healthz", None)),
                     c, timeout)


def stop(c: ClusterConfig) -> None:
    for name in reversed(COMPONENTS):
        processes.stop(name, c.pid_dir, timeout=10.0)
