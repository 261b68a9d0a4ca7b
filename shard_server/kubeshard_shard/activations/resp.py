"""Reads the replies of pipelined MGETs straight from a Redis connection's socket.

A chain of KV blocks is 16-50 MB for 1,000 tokens. redis-py's parser reads 32 KiB at a
time into its own buffer, then copies each value into a new ``bytes``: the fetch took
about twice as long as the bytes need on loopback. This reader takes the small RESP
framing (``*<n>``, ``$<len>``, ``$-1``, RESP3's ``_``, ``-ERR``) through a small buffer
and reads each value's bytes with ``recv_into`` into one reused buffer (the GIL is free
while the kernel copies), which ``on_value`` sees as a memoryview valid only during
the call.

The connection's socket comes from redis-py (so AUTH, SELECT and TLS are its own); the
replies are read in full, or the caller drops the connection.
"""

from __future__ import annotations

import socket
from typing import Callable

from redis.exceptions import ResponseError

LINE_MAX = 1 << 16  # a RESP line (a count, a length, an error) is far shorter


class ProtocolError(ConnectionError):
    """The bytes on the socket are not the replies expected: the connection is dropped."""


class ReplyReader:
    def __init__(self, sock: socket.socket, max_value: int) -> None:
        self.sock = sock
        self.max_value = max_value
        self._buf = bytearray(LINE_MAX)
        self._start = self._end = 0
        self._value = bytearray(0)

    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):  # move what is left to the front
            left = self._end - self._start
            self._buf[:left] = self._buf[self._start:self._end]
            self._start, self._end = 0, left
        n = self.sock.recv_into(memoryview(self._buf)[self._end:])
        if n == 0:
            raise ProtocolError("Redis closed the connection")
        self._end += n

    def line(self) -> bytes:
        while True:
            at = self._buf.find(b"\r\n", self._start, self._end)
            if at >= 0:
                out = bytes(self._buf[self._start:at])
                self._start = at + 2
                return out
            if self._end - self._start >= LINE_MAX - 2:
                raise ProtocolError("a RESP line longer than 64 KiB")
            self._fill()

    def _read_into(self, view: memoryview) -> None:
        """Fills ``view``: first from what is buffered, then straight from the socket."""
        have = min(self._end - self._start, len(view))
        view[:have] = self._buf[self._start:self._start + have]
        self._start += have
        got = have
        while got < len(view):
            n = self.sock.recv_into(view[got:])
            if n == 0:
                raise ProtocolError("Redis closed the connection")
            got += n

    def _crlf(self) -> None:
        while self._end - self._start < 2:
            self._fill()
        if self._buf[self._start:self._start + 2] != b"\r\n":
            raise ProtocolError("a bulk string not followed by CRLF")
        self._start += 2

    @property
    def drained(self) -> bool:
        """Nothing was read past the replies."""
        return self._start == self._end

    def array_length(self) -> int:
        head = self.line()
        if head[:1] == b"*":
            return int(head[1:])
        if head[:1] == b"-":
            raise ResponseError(head[1:].decode(errors="replace"))
        raise ProtocolError(f"expected an array, got {head[:32]!r}")

    def value(self) -> memoryview | None:
        """The next bulk string (a view of the reused buffer), None for a nil, or an
        empty view when it is longer than ``max_value`` (its bytes stay unread: the
        caller must stop and drop the connection)."""
        head = self.line()
        kind = head[:1]
        if kind == b"_" or head == b"$-1":
            return None
        if kind == b"-":
            raise ResponseError(head[1:].decode(errors="replace"))
        if kind != b"$":
            raise ProtocolError(f"expected a bulk string, got {head[:32]!r}")
        size = int(head[1:])
        if size > self.max_value:
            return memoryview(b"")
        if len(self._value) < size:
            self._value = bytearray(size)
        view = memoryview(self._value)[:size]
        self._read_into(view)
        self._crlf()
        return view


def read_mget_replies(sock: socket.socket, counts: list[int], max_value: int,
                      on_value: Callable[[int, memoryview | None], bool]) -> bool:
    """Reads the replies of MGETs of ``counts[i]`` keys each, calling ``on_value(index,
    value)`` in order until it answers False. True when every reply was read (the
    connection is in sync), False when it stopped early (drop the connection)."""
    reader = ReplyReader(sock, max_value)
    index = 0
    for count in counts:
        if reader.array_length() != count:
            raise ProtocolError(f"an MGET of {count} keys answered another count")
        for _ in range(count):
            value = reader.value()
            if not on_value(index, value) or (value is not None and len(value) == 0):
                return False  # an empty view may leave an oversized value unread
            index += 1
    return reader.drained
