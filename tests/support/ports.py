"""Loopback ports for the servers tests and benchmarks start."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# below the kernel's ephemeral range (32768-60999 by default) and the local cluster's
# ports (26xxx-29xxx, e2e/cluster/config.py)
_RESERVABLE = range(20000, 26000)


def reservable_port() -> int:
    """A free port for another process to bind later (a group's rendezvous port): one
    from ``free_port`` lies in the ephemeral range, where any socket bound to port 0
    meanwhile may take it (a leader's own gRPC server once took its group's master port)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [p for p in _RESERVABLE if p < low]
    for port in random.sample(ports, min(len(ports), 200)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_RESERVABLE.start}-{_RESERVABLE.stop - 1} below the ephemeral range")
