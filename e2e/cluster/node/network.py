"""Pod sandboxes: a network and UTS namespace per pod, held by a sleeping process.

Like a real runtime's pause container, a `sleep infinity` started under `unshare --net
--uts` owns the pod's namespaces; containers join them through /proc/<pid>/ns. Nothing
is bind-mounted under /run/netns, so there is no mount to leave behind: when the pause
process dies the namespace and the pod's veth go with it. Its argv[0] carries a marker
(config.PAUSE_MARKER) so a teardown after a crash finds every sandbox.

Inside, eth0 has the pod IP on the node's /24, and only the cluster and Service ranges
are routed (via the node gateway): there is deliberately no default route, so a pod
cannot send anything off this machine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import os
import subprocess
import threading
import time

from .. import processes
from ..config import BRIDGE, PAUSE_MARKER, VETH_PREFIX, ClusterConfig, NodeSpec


class SandboxError(RuntimeError):
    pass


@dataclasses.dataclass
class Sandbox:
    uid: str
    pid: int | None  # None for hostNetwork pods
    ip: str

    def ns_path(self, kind: str) -> str | None:
        return None if self.pid is None else f"/proc/{self.pid}/ns/{kind}"

    def alive(self) -> bool:
        return self.pid is None or processes.start_time(self.pid) is not None


class Ipam:
    """Pod IPs from one node's /24, handed out round-robin so a freed IP rests a while."""

    def __init__(self, cidr: str) -> None:
        net = ipaddress.ip_network(cidr)
        self._pool = [str(ip) for ip in list(net.hosts())[1:]]  # .1 is the gateway
        self._used: set[str] = set()
        self._next = 0
        self._lock = threading.Lock()

    def allocate(self) -> str:
        with self._lock:
            for i in range(len(self._pool)):
                ip = self._pool[(self._next + i) % len(self._pool)]
                if ip not in self._used:
                    self._used.add(ip)
                    self._next = (self._next + i + 1) % len(self._pool)
                    return ip
        raise SandboxError("the node's pod CIDR is exhausted")

    def release(self, ip: str) -> None:
        with self._lock:
            self._used.discard(ip)


def _run(*argv: str, input: str | None = None) -> None:
    proc = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise SandboxError(f"`{' '.join(argv)}` failed: {proc.stderr.strip()}")


def create(uid: str, ip: str, node: NodeSpec, config: ClusterConfig) -> Sandbox:
    proc = subprocess.Popen(
        ["unshare", "--net", "--uts", "--", "bash", "-c", f"exec -a {PAUSE_MARKER}{uid} sleep infinity"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    processes._children[proc.pid] = proc  # reaped by processes.terminate
    host_net = os.readlink("/proc/self/ns/net")
    deadline = time.monotonic() + 10
    while True:  # wait until unshare has made the namespaces and exec'd the pause
        try:
            argv0 = open(f"/proc/{proc.pid}/cmdline", "rb").read().split(b"\0")[0].decode()
            if argv0.startswith(PAUSE_MARKER) and os.readlink(f"/proc/{proc.pid}/ns/net") != host_net:
                break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SandboxError(f"pod sandbox for {uid} did not start (exit {proc.poll()})")
        time.sleep(0.01)
    sandbox = Sandbox(uid, proc.pid, ip)
    try:
        veth = VETH_PREFIX + hashlib.sha1(uid.encode()).hexdigest()[:11]
        prefix = node.pod_cidr.split("/")[1]
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", str(proc.pid))
        _run("ip", "link", "set", veth, "master", BRIDGE, "up")
        batch = "\n".join([
            "link set lo up",
            f"addr add {ip}/{prefix} dev eth0",
            "link set eth0 up",
            f"route add {config.cluster_cidr} via {node.gateway}",
            f"route add {config.service_cidr} via {node.gateway}",
        ])
        _run("nsenter", "-t", str(proc.pid), "-n", "ip", "-batch", "-", input=batch + "\n")
    except Exception:
        destroy(sandbox)
        raise
    return sandbox


def host_network(uid: str, node: NodeSpec) -> Sandbox:
    return Sandbox(uid, None, node.gateway)


def destroy(sandbox: Sandbox) -> None:
    """Kill the pause process; the kernel then removes the namespace and the veth."""
    if sandbox.pid is not None:
        processes.terminate(sandbox.pid, timeout=0.0)
