"""The activation cache's own reader of MGET replies (``activations.resp``): against a real
redis-server through ``RedisTier.fetch_chain``, and on hand-written RESP bytes through a
socket pair for the replies a single server does not give on demand (an error reply,
RESP3's nil, a connection closed mid-value)."""

from __future__ import annotations

import os
import socket
import threading

import pytest
import redis
from redis.exceptions import ResponseError

from kubeshard_shard.activations.resp import ProtocolError, read_mget_replies
from kubeshard_shard.activations.store import MGET_BLOCKS, RedisTier


def _values(n: int, size: int) -> list[bytes]:
    return [os.urandom(size) for _ in range(n)]


def _fetch(tier: RedisTier, keys: list[str], max_value: int, stop_at: int | None = None) -> list[bytes | None]:
    got: list[bytes | None] = []

    def take(i: int, value) -> bool:
        got.append(None if value is None else bytes(value))
        return value is not None and i != stop_at

    tier.fetch_chain(keys, take, max_value)
    return got


def test_a_chain_of_large_values_with_a_gap_and_the_connection_reused(redis_url):
    client = redis.Redis.from_url(redis_url)
    values = _values(3 * MGET_BLOCKS + 3, 700_000)          # several MGETs, values of many socket reads
    keys = [f"kubeshard:m:{{t}}:{i}" for i in range(len(values))]
    for k, v in zip(keys, values):
        client.set(k, v)
    tier = RedisTier(redis_url, 5.0)
    assert _fetch(tier, keys, 1 << 20) == values
    assert _fetch(tier, keys, 1 << 20) == values             # the same connection, in sync
    client.delete(keys[11])
    assert _fetch(tier, keys, 1 << 20) == values[:11] + [None]   # stops at the first gap
    assert _fetch(tier, keys, 1 << 20, stop_at=2) == values[:3]  # a caller's stop mid-reply
    assert tier.run("ping", lambda c: c.ping())              # a dropped connection was not reused
    assert _fetch(tier, keys[:5], 1 << 20) == values[:5]
    assert tier.errors == 0
    client.close()
    tier.close()


def test_a_value_over_the_limit_is_not_read(redis_url):
    client = redis.Redis.from_url(redis_url)
    values = _values(4, 4096)
    values[2] = os.urandom(1 << 20)                          # too big for the layout
    keys = [f"kubeshard:m:{{t}}:{i}" for i in range(4)]
    for k, v in zip(keys, values):
        client.set(k, v)
    tier = RedisTier(redis_url, 5.0)
    got: list = []
    tier.fetch_chain(keys, lambda i, v: got.append(bytes(v)) or True, 8192)
    assert got == values[:2] + [b""]                         # an empty view, then the end
    assert _fetch(tier, keys[:2], 8192) == values[:2]        # the next fetch on a fresh connection
    client.close()
    tier.close()


def _serve(data: bytes, close: bool = False) -> socket.socket:
    ours, theirs = socket.socketpair()

    def send():
        theirs.sendall(data)
        if close:
            theirs.close()

    threading.Thread(target=send, daemon=True).start()
    ours.settimeout(5)
    return ours


def test_nils_in_resp2_and_resp3_and_an_error_reply():
    sock = _serve(b"*3\r\n$3\r\nabc\r\n$-1\r\n_\r\n")
    got = []
    assert read_mget_replies(sock, [3], 100, lambda i, v: got.append(None if v is None else bytes(v)) or True)
    assert got == [b"abc", None, None]
    sock = _serve(b"-MOVED 1234 127.0.0.1:7001\r\n")
    with pytest.raises(ResponseError, match="MOVED"):
        read_mget_replies(sock, [2], 100, lambda i, v: True)


def test_a_connection_closed_mid_value_or_a_wrong_reply_is_a_protocol_error():
    with pytest.raises(ProtocolError):
        read_mget_replies(_serve(b"*1\r\n$10\r\nabc", close=True), [1], 100, lambda i, v: True)
    with pytest.raises(ProtocolError):
        read_mget_replies(_serve(b"*2\r\n$1\r\na\r\n"), [3], 100, lambda i, v: True)
    with pytest.raises(ProtocolError):
        read_mget_replies(_serve(b"*1\r\n$3\r\nabcXY"), [1], 100, lambda i, v: True)
