"""Loopback ports for the servers tests and benchmarks start: the launcher's picks, below
the kernel's ephemeral range (``kubeshard_shard.ports`` says why)."""

from __future__ import annotations

from kubeshard_shard.ports import free_port

__all__ = ["free_port"]
