"""What one rank's KV block holds, and the Redis keys that name it.

A block's entry is keyed by everything that decides its bytes: the model and revision,
the dtype, the block size, the sharding layout (``full``: every KV head, as in a
single process or a zero3 rank; ``tp2.r1``: rank 1's heads of a 2-way tensor group)
and the block's chained hash::

    kubeshard:{model}:{revision}:kv:{dtype}:b{block_size}:{layout}:{{root}}:{block hash}

``{dtype}`` is the KV pool's dtype, followed by what else computed the keys and values
when that is not the plain model in that dtype: ``-from-{compute dtype}`` when the pool
stores another dtype than the model computes in (``--kv-cache-dtype``), and
``-w{quantization}`` for quantized weights (``int8``, ``int4g32``, ``gguf.<types
digest>``), e.g. ``bfloat16-from-float32-wint4g32``. Replicas whose blocks differ in
their bytes never share keys, and an entry's header digest refuses a value written
under another variant anyway.

``{root}`` is the first block of the prompt's chain, in braces: a Redis Cluster hashes
only that part, so every block of one prefix lands in one slot and a whole chain comes
back in one round trip, while different prefixes spread over the nodes. The counter of
how many prompts held each block of a chain lives in the same slot. Every key starts
with ``kubeshard:{model}:``, which the operator's finalizer deletes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

import torch

DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hex_hash(h: int) -> str:
    return f"{h:032x}"


def count_field(h: int) -> bytes:
    """A block's field in its chain's counter: 64 bits of its hash, raw (a third of the
    memory of the hex name; a collision only merges two blocks' counts)."""
    return (h & ((1 << 64) - 1)).to_bytes(8, "little")


def root_tag(root: int) -> str:
    """The Cluster hash tag of a chain: 64 bits of its first block's hash."""
    return f"{root >> 64:016x}"


@dataclass(frozen=True)
class KVLayout:
    """Everything that decides the bytes of one rank's KV block: the parts of its Redis key
    and the shape of the tensor it stores."""

    model: str
    revision: str
    dtype: torch.dtype
    block_size: int
    num_layers: int
    num_kv_heads: int   # heads this rank keeps
    head_dim: int
    sharding: str = "full"
    compute_dtype: torch.dtype | None = None  # the model's dtype, when the pool stores another one
    weights: str = "none"                     # weight quantization: none, int8, int4g32, gguf.<digest>

    @classmethod
    def for_rank(cls, model: str, revision: str, dtype: torch.dtype, block_size: int, num_layers: int,
                 num_kv_heads: int, head_dim: int, splits_heads: bool, shards: int, rank: int,
                 compute_dtype: torch.dtype | None = None, weights: str = "none") -> "KVLayout":
        """A rank that keeps a slice of the heads (``Strategy.splits_kv_heads``: a tensor
        rank) has entries of its own; a single process and every zero3 rank keep them all
        (and so share entries)."""
        sharding = f"tp{shards}.r{rank}" if splits_heads and shards > 1 else "full"
        return cls(model, revision, dtype, block_size, num_layers, num_kv_heads, head_dim, sharding,
                   compute_dtype, weights)

    def __post_init__(self) -> None:
        if self.compute_dtype == self.dtype:  # one spelling per variant: the same bytes, the same key
            object.__setattr__(self, "compute_dtype", None)

    def of_rank(self, shards: int, rank: int) -> "KVLayout":
        """The same model's layout on another rank of a tensor group."""
        return replace(self, sharding=f"tp{shards}.r{rank}") if self.sharding != "full" else self

    @property
    def element_size(self) -> int:
        return torch.tensor([], dtype=self.dtype).element_size()

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        n = 1
        for d in self.block_shape:
            n *= d
        return n * self.element_size

    @property
    def variant(self) -> str:
        """The pool's dtype and what else decides the bytes: the compute dtype when it
        differs, the weight quantization when there is one."""
        out = DTYPE_NAMES[self.dtype]
        if self.compute_dtype is not None:
            out += f"-from-{DTYPE_NAMES[self.compute_dtype]}"
        if self.weights != "none":
            out += f"-w{self.weights}"
        return out

    @property
    def digest(self) -> bytes:
        """8 bytes that every entry carries: a value under the wrong key, or from another
        model, revision, dtype, compute dtype, weight quantization or layout, never
        passes for this one."""
        text = "\0".join([self.model, self.revision, DTYPE_NAMES[self.dtype], self.sharding,
                          *map(str, self.block_shape)])
        if self.variant != DTYPE_NAMES[self.dtype]:  # a plain layout keeps the digest it always had
            text += "\0" + self.variant
        return hashlib.blake2b(text.encode(), digest_size=8).digest()

    @property
    def prefix(self) -> str:
        return f"kubeshard:{self.model}:{self.revision}:kv:{self.variant}:b{self.block_size}:{self.sharding}"

    def key(self, root: int, block_hash: int) -> str:
        return f"{self.prefix}:{{{root_tag(root)}}}:{hex_hash(block_hash)}"

    def seen_key(self, root: int) -> str:
        """Hash of per-block counts: how many prompts held each block of the chain (per
        block, not per prompt: two prompts that share only a prefix count its blocks
        twice, which is what ``min_hits`` asks)."""
        return f"kubeshard:{self.model}:{self.revision}:kv:b{self.block_size}:seen:{{{root_tag(root)}}}"

    def budget_keys(self) -> tuple[str, str]:
        """(bytes counter, index of written entries) of the model's byte budget; one slot."""
        tag = hashlib.blake2b(self.model.encode(), digest_size=6).hexdigest()
        base = f"kubeshard:{self.model}:kv:budget:{{{tag}}}"
        return f"{base}:bytes", f"{base}:index"
