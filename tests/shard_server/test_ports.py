"""Ports picked for another process to bind later: below the kernel's ephemeral range,
never one that is taken, the kernel's pick where that range has none."""

from __future__ import annotations

import socket

from kubeshard_shard import ports


def test_a_pick_is_free_and_below_the_ephemeral_range():
    start = ports._ephemeral_start()
    for _ in range(20):
        port = ports.free_port()
        assert 20000 <= port < min(26000, start), port
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: binds


def test_a_taken_port_is_never_picked(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        monkeypatch.setattr(ports, "_RANGE", range(port, port + 1))
        monkeypatch.setattr(ports, "_ephemeral_start", lambda: 65536)
        picked = ports.free_port()
        assert picked != port  # the range's one port is taken: the kernel picked
        with socket.socket() as s:
            s.bind(("127.0.0.1", picked))


def test_without_room_below_the_ephemeral_range_the_kernel_picks(monkeypatch):
    start = ports._ephemeral_start()
    monkeypatch.setattr(ports, "_ephemeral_start", lambda: 1024)  # a range from 1024 up
    assert ports.free_port() >= start  # the kernel's pick, in the machine's real range
