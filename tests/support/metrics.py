"""Reading a server's Prometheus ``/metrics`` page."""

from __future__ import annotations

from typing import Protocol

import httpx


class HasUrl(Protocol):
    url: str


def metric(server: HasUrl, name: str) -> float:
    """The sum of every sample whose line starts with ``name`` (a name, or a name and labels)."""
    total = 0.0
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total
