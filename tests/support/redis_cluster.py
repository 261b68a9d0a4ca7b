"""A real three-node Redis Cluster on loopback ports, for tests (no replicas)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def _free_cluster_port() -> int:
    """A free port whose cluster-bus port (port + 10000) is free and valid too."""
    import random

    for _ in range(200):
        port = random.randint(20000, 45000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
                return port
        except OSError:
            continue
    raise RuntimeError("no free port pair for a Redis Cluster node")


def _command(port: int, *args: str) -> bytes:
    parts = [b"*%d\r\n" % len(args)] + [b"$%d\r\n%s\r\n" % (len(a), a.encode()) for a in args]
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(b"".join(parts))
        return s.recv(65536)


class RedisCluster:
    def __init__(self, nodes: int = 3) -> None:
        for tool in ("redis-server", "redis-cli"):
            if shutil.which(tool) is None:
                raise RuntimeError(f"{tool} not found: run `make system-deps` (hack/ensure-system-deps.sh)")
        self.ports = [_free_cluster_port() for _ in range(nodes)]
        self.dir = Path(tempfile.mkdtemp(prefix="kubeshard-redis-cluster-"))
        self.procs: list[subprocess.Popen] = []

    @property
    def url(self) -> str:
        """A seed node; the client finds the others."""
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def start(self, timeout: float = 30.0, create: bool = True) -> None:
        """Starts the nodes and (``create``) assigns them every slot; without it the
        nodes run in cluster mode with no slot covered (a broken cluster)."""
        for port in self.ports:
            workdir = self.dir / str(port)
            workdir.mkdir()
            self.procs.append(subprocess.Popen(
                ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                 "--cluster-config-file", "nodes.conf", "--save", "", "--appendonly", "no", "--dir", str(workdir)],
                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        for port in self.ports:
            while True:
                try:
                    if _command(port, "PING").startswith(b"+PONG"):
                        break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"cluster node {port} did not start")
                time.sleep(0.05)
        if not create:
            return
        subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=30)
        while not all(b"cluster_state:ok" in _command(p, "CLUSTER", "INFO") for p in self.ports):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not reach cluster_state:ok")
            time.sleep(0.1)

    def node_of(self, key: str) -> int:
        """The port of the node that holds ``key``'s slot."""
        import redis

        client = redis.Redis(port=self.ports[0])
        try:
            slot = client.cluster("keyslot", key)
            for start, end, (_host, port, *_), *_ in client.cluster("slots"):
                if start <= slot <= end:
                    return int(port)
        finally:
            client.close()
        raise RuntimeError(f"no node holds the slot of {key}")

    def kill(self, port: int) -> None:
        """Kills one node (SIGKILL): the others still list it as the owner of its slots."""
        proc = self.procs[self.ports.index(port)]
        proc.kill()
        proc.wait(10)

    def keys(self) -> dict[int, list[bytes]]:
        """Every node's keys (port -> keys)."""
        import redis

        out = {}
        for port in self.ports:
            client = redis.Redis(port=port)
            out[port] = list(client.scan_iter(count=1000))
            client.close()
        return out

    def close(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
