"""A shard group's communicator: rendezvous, agreement checks, and collectives.

Two timeouts: rendezvous and loading may take long (workers wait for their leader,
which may be pulling a model), so torch's default process group uses ``--dist-timeout``;
every collective of the serving loop runs on a second process group with a short timeout, so a dead
or stuck peer ends the whole group within bounded time instead of hanging it.
On CUDA one process group carries both backends: NCCL for tensors on the GPU, gloo for the
control messages that stay on the CPU.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kubeshard_shard.config import STRATEGIES, Placement

log = logging.getLogger(__name__)

STEP_TIMEOUT_S = 20.0


class GroupError(RuntimeError):
    """The group cannot form or lost a member; the message says which and why."""


def wait_for_leader(cfg: Placement) -> None:
    """Non-leader ranks probe the leader's rendezvous port first, so that an address
    that never answers fails with the address in the message (torch's own error
    does not say what it tried)."""
    if cfg.rank == 0:
        return
    deadline = time.monotonic() + cfg.timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((cfg.master_addr, cfg.master_port), timeout=2):
                return
        except OSError as exc:
            last = exc
            time.sleep(0.5)
    raise GroupError(f"rank {cfg.rank} could not reach the leader at {cfg.master_addr}:{cfg.master_port} "
                     f"within {cfg.timeout_s:.0f}s ({last})")


@dataclass
class Comm:
    """This rank's view of its group."""

    rank: int
    shards: int
    device: torch.device
    step_group: object  # the process group of the serving loop (short timeout)
    # seconds spent inside collectives of the serving loop (waiting included)
    comm_seconds: float = 0.0

    def _timed(self, fn, *args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.comm_seconds += time.perf_counter() - started

    def wait(self, work) -> None:
        """Waits for an async collective, counting the wait as communication."""
        self._timed(work.wait)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self._timed(dist.all_reduce, t, group=self.step_group)
        return t

    def gather_last_dim(self, t: torch.Tensor) -> torch.Tensor | None:
        """Concatenates every rank's ``t`` along the last dimension on the leader
        (None elsewhere)."""
        t = t.contiguous()
        if self.is_leader:
            parts = [torch.empty_like(t) for _ in range(self.shards)]
            self._timed(dist.gather, t, parts, dst=0, group=self.step_group)
            return torch.cat(parts, dim=-1)
        self._timed(dist.gather, t, None, dst=0, group=self.step_group)
        return None

    def gather_rows(self, t: torch.Tensor, rows: list[int]) -> list[torch.Tensor] | None:
        """Gathers each rank's ``t`` ([rows[r], ...]) on the leader, padded to the
        largest row count for the collective."""
        width = max(rows)
        padded = torch.zeros((width, *t.shape[1:]), dtype=t.dtype, device=t.device)
        padded[: t.shape[0]] = t
        if self.is_leader:
            parts = [torch.empty_like(padded) for _ in range(self.shards)]
            self._timed(dist.gather, padded, parts, dst=0, group=self.step_group)
            return [p[:n] for p, n in zip(parts, rows)]
        self._timed(dist.gather, padded, None, dst=0, group=self.step_group)
        return None

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        self._timed(dist.broadcast, t, src=0, group=self.step_group)
        return t

    def all_gather_into(self, out: torch.Tensor, local: torch.Tensor, async_op: bool = False):
        return self._timed(dist.all_gather_into_tensor, out, local, group=self.step_group, async_op=async_op)

    def all_gather_row(self, values: list[int], patient: bool = False) -> list[list[int]]:
        """Every rank's row of ints (rows of equal length), on every rank; a serving-loop
        collective (short timeout), or with ``patient`` one on the default group (the
        long timeout: the ranks answer after work of seconds, such as loading an adapter)."""
        t = torch.tensor(values, dtype=torch.long)
        out = [torch.empty_like(t) for _ in range(self.shards)]
        self._timed(dist.all_gather, out, t, group=None if patient else self.step_group)
        return [o.tolist() for o in out]

    def min_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        t = torch.tensor(values, dtype=torch.long)
        out = [torch.empty_like(t) for _ in range(self.shards)]
        dist.all_gather(out, t)
        return [o.tolist() for o in out]

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # the group may already be broken; we are exiting anyway
                pass


def init_group(cfg: Placement, device: torch.device, step_timeout_s: float = STEP_TIMEOUT_S) -> Comm:
    wait_for_leader(cfg)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    try:
        dist.init_process_group(backend=backend, init_method=f"tcp://{cfg.master_addr}:{cfg.master_port}",
                                rank=cfg.rank, world_size=cfg.shards,
                                timeout=datetime.timedelta(seconds=cfg.timeout_s))
    except Exception as exc:
        raise GroupError(f"rank {cfg.rank} could not join the group of {cfg.shards} at "
                         f"{cfg.master_addr}:{cfg.master_port}: {exc}") from exc
    step_group = dist.new_group(list(range(cfg.shards)), timeout=datetime.timedelta(seconds=step_timeout_s),
                                backend=backend)
    log.info("rank %d of %d joined the group at %s:%d (%s)", cfg.rank, cfg.shards, cfg.master_addr,
             cfg.master_port, backend)
    return Comm(cfg.rank, cfg.shards, device, step_group)


def fingerprint(text: bytes) -> int:
    return int.from_bytes(hashlib.sha256(text).digest()[:7], "big")


def check_agreement(comm: Comm, strategy: str, model_fingerprint: int, engine_fingerprint: int) -> None:
    """Every rank must run the same strategy on the same model with the same engine
    settings; a mismatch stops the whole group with a message naming the ranks."""
    rows = comm.all_gather_ints([STRATEGIES.index(strategy), comm.shards, model_fingerprint,
                                 engine_fingerprint])
    leader = rows[0]
    problems = []
    for rank, row in enumerate(rows[1:], start=1):
        if row[0] != leader[0]:
            problems.append(f"rank {rank} runs --strategy {STRATEGIES[row[0]]} but the leader runs "
                            f"{STRATEGIES[leader[0]]}")
        if row[1] != leader[1]:
            problems.append(f"rank {rank} expects {row[1]} shards but the leader expects {leader[1]}")
        if row[2] != leader[2]:
            problems.append(f"rank {rank} loads a different model (config.json differs from the leader's)")
        if row[3] != leader[3]:
            problems.append(f"rank {rank} has different engine settings from the leader (--dtype, limits, "
                            "--block-size, --max-batch-tokens, activation cache, --quantize, "
                            "--quantize-group-size, --kv-cache-dtype or --cpu-gemm)")
    if problems:
        raise GroupError("the shard group is misconfigured: " + "; ".join(problems))
