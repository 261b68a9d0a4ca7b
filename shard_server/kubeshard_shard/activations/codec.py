"""One entry's bytes: a 64-byte versioned header, then one rank's block of K and V.

Header (little-endian)::

    magic "KSKV" | version u8 | dtype u8 | flags u16 | layers u16 | block size u16 |
    KV heads u16 | head dim u16 | payload bytes u64 | layout digest 8B |
    block hash 16B | xxh3-64 of the payload u64 | 8 reserved bytes

The payload is the block as the pool holds it: [layers, 2 (K, V), block size, KV heads,
head dim] in the model's dtype, C order, little-endian. ``decode`` refuses, with a
reason, anything that is not exactly this block of this layout: too short or long
(``truncated``), another format or version (``format``), another model, revision,
dtype, layout or block (``mismatch``), altered bytes (``checksum``).
"""

from __future__ import annotations

import struct

import numpy as np
import torch
import xxhash

from kubeshard_shard.activations.layout import DTYPE_CODES, KVLayout

MAGIC = b"KSKV"
VERSION = 1
HEADER = struct.Struct("<4sBBHHHHHQ8s16sQ8x")
HEADER_BYTES = HEADER.size  # 64


class EntryRejected(ValueError):
    """An entry that must not be used; ``reason`` is one of the module's four."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def encode(layout: KVLayout, block_hash: int, block) -> bytes:
    """``block``: the block's bytes (C order), or a CPU tensor of ``layout.block_shape``
    and dtype."""
    if isinstance(block, torch.Tensor):
        if tuple(block.shape) != layout.block_shape or block.dtype != layout.dtype or block.device.type != "cpu":
            raise ValueError(f"block {tuple(block.shape)} {block.dtype} on {block.device} does not match "
                             f"{layout.block_shape} {layout.dtype}")
        block = block.contiguous().view(torch.uint8).numpy()
    payload = memoryview(block).cast("B")
    if payload.nbytes != layout.block_bytes:
        raise ValueError(f"a block of {layout.block_shape} {layout.dtype} has {layout.block_bytes} bytes, "
                         f"not {payload.nbytes}")
    header = HEADER.pack(MAGIC, VERSION, DTYPE_CODES[layout.dtype], 0, layout.num_layers, layout.block_size,
                         layout.num_kv_heads, layout.head_dim, payload.nbytes, layout.digest,
                         block_hash.to_bytes(16, "little"), xxhash.xxh3_64_intdigest(payload))
    return header + payload


def decode(value: bytes | memoryview, layout: KVLayout, block_hash: int) -> memoryview:
    """The payload of an entry that is exactly ``block_hash``'s block in ``layout``."""
    if len(value) < HEADER_BYTES:
        raise EntryRejected("truncated", f"{len(value)} bytes, shorter than the header")
    (magic, version, dtype, _flags, layers, block_size, heads, head_dim, size, digest, hashed,
     checksum) = HEADER.unpack_from(value)
    if magic != MAGIC or version != VERSION:
        raise EntryRejected("format", f"magic {magic!r} version {version}")
    if (dtype, layers, block_size, heads, head_dim) != (DTYPE_CODES[layout.dtype], layout.num_layers,
                                                        layout.block_size, layout.num_kv_heads, layout.head_dim):
        raise EntryRejected("mismatch", f"dtype {dtype}, shape {layers}x{block_size}x{heads}x{head_dim}")
    if digest != layout.digest or hashed != block_hash.to_bytes(16, "little"):
        raise EntryRejected("mismatch", "another model, revision, layout or block")
    if size != layout.block_bytes or len(value) != HEADER_BYTES + size:
        raise EntryRejected("truncated", f"{len(value) - HEADER_BYTES} payload bytes, expected {layout.block_bytes}")
    payload = memoryview(value)[HEADER_BYTES:]
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        raise EntryRejected("checksum", "the payload does not match its checksum")
    return payload


SAME_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def as_array(payload: memoryview, layout: KVLayout) -> np.ndarray:
    """A read-only view of a decoded payload, [layers, 2, block size, KV heads, head dim],
    as integers of the dtype's size (the bits, for copying; numpy has no bfloat16)."""
    return np.frombuffer(payload, dtype=SAME_SIZE[layout.element_size]).reshape(layout.block_shape)


def as_block(payload: memoryview, layout: KVLayout) -> torch.Tensor:
    """A decoded payload as a tensor of the layout's dtype (a copy)."""
    return torch.from_numpy(as_array(payload, layout).copy()).view(layout.dtype)
