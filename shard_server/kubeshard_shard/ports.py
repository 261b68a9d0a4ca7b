"""Loopback ports picked by one process for another to bind later (the launcher's
children, the servers tests start).

Why not the kernel's pick (bind port 0, read it, close): that port lies in the kernel's
ephemeral range, which it also hands to every outgoing connection, so between the pick
and the child's bind any connect() may take it (a `kubeshard serve` router under test
once failed to bind its port so, and a group's rendezvous port was once taken by its own
leader's gRPC server). Ports below that range are bound only on purpose.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

# below the kernel's ephemeral range (32768-60999 by default) and the local test
# cluster's ports (26xxx-29xxx, e2e/cluster/config.py)
_RANGE = range(20000, 26000)


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, below the ephemeral range (drawn at random, so that
    pickers at the same time rarely meet); the kernel's pick where that range has none."""
    start = _ephemeral_start()
    ports = [p for p in _RANGE if p < start]
    for port in random.sample(ports, min(len(ports), 200)):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
