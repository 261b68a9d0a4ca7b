"""Redis response cache for deterministic requests (greedy, or sampled with a fixed seed).

An entry is the engine's token stream for one normalized request, stored under
``kubeshard:{model}:{revision}:cache:{digest}`` with a TTL. The digest covers the prompt
token ids and every parameter that decides the output, not the API that asked, so each
front end re-renders the same tokens into its own shapes: a hit replays as the same SSE
events a miss produced. Entries are the serialized ``Token`` messages, length-prefixed.

``Cache-Control: no-cache`` skips the lookup (the fresh answer is still stored);
``no-store`` skips both. A down or slow Redis is a miss, never an error.
"""

from __future__ import annotations

import struct
from typing import Optional

from kubeshard_proto import pb
from kubeshard_router.engine_request import EngineRequest
from kubeshard_router.redis_store import RedisStore, StoreUnavailable

_LEN = struct.Struct(">I")
FORMAT = b"KS1"


def cache_key(model: str, revision: str, request: EngineRequest) -> str:
    return f"kubeshard:{model}:{revision}:cache:{request.fingerprint()}"


def encode_tokens(tokens: list[pb.Token]) -> bytes:
    parts = [FORMAT]
    for token in tokens:
        data = token.SerializeToString()
        parts.append(_LEN.pack(len(data)))
        parts.append(data)
    return b"".join(parts)


def decode_tokens(blob: bytes) -> Optional[list[pb.Token]]:
    """The token list, or None for an entry this router cannot read (skipped, not fatal)."""
    if not blob.startswith(FORMAT):
        return None
    tokens: list[pb.Token] = []
    offset, end = len(FORMAT), len(blob)
    try:
        while offset < end:
            (size,) = _LEN.unpack_from(blob, offset)
            offset += _LEN.size
            token = pb.Token()
            token.ParseFromString(blob[offset: offset + size])
            offset += size
            tokens.append(token)
    except Exception:
        return None
    if not tokens or not tokens[-1].HasField("finish"):
        return None
    return tokens


class CacheControl:
    __slots__ = ("read", "write")

    def __init__(self, header: Optional[str]) -> None:
        directives = {d.strip().lower() for d in header.split(",")} if header else set()
        self.write = "no-store" not in directives
        self.read = self.write and "no-cache" not in directives


class ResponseCache:
    def __init__(self, store: RedisStore, *, ttl_s: int, max_entry_bytes: int) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.max_entry_bytes = max_entry_bytes

    async def get(self, key: str) -> Optional[list[pb.Token]]:
        try:
            blob = await self.store.run("cache_get", lambda r: r.get(key))
        except StoreUnavailable:
            return None
        return decode_tokens(blob) if blob else None

    def put(self, key: str, tokens: list[pb.Token]) -> None:
        """Stores in the background; never delays the response."""
        if not tokens or not tokens[-1].HasField("finish"):
            return
        blob = encode_tokens(tokens)
        if len(blob) > self.max_entry_bytes:
            return
        self.store.fire("cache_put", lambda r: r.set(key, blob, ex=self.ttl_s))
