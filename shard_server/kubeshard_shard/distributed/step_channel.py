"""The leader tells its ranks what to compute, one message per engine step.

A step is a list of ``StepInputs``, one per lane (one for tensor parallel, one per
rank for zero3; each row's LoRA adapter slot with them), flattened into a single int64
tensor and broadcast after a fixed-size header; no pickles cross the wire. When the
engine is idle the leader sends a heartbeat, so followers never wait longer than the
step timeout unless the leader is gone — then they fail and exit. A CACHE message carries the activation cache's
``CacheOps`` (transfers between the ranks' KV pools and Redis); every rank answers it
with one row of ints, gathered by all. A LORA message carries a runtime adapter load or
unload (``models.lora.LoraCommand``), answered the same way.
"""

from __future__ import annotations

import enum

import torch

from kubeshard_shard.activations.ops import CacheOps
from kubeshard_shard.distributed.comm import Comm
from kubeshard_shard.engine.model_runner import StepInputs
from kubeshard_shard.models.lora import LoraCommand

HEADER = 4


class Command(enum.IntEnum):
    STEP = 1
    HEARTBEAT = 2
    STOP = 3
    CACHE = 4
    LORA = 5


def encode(inputs: list[StepInputs | None]) -> torch.Tensor:
    parts: list[torch.Tensor] = []
    for item in inputs:
        if item is None:
            parts.append(torch.zeros(1, dtype=torch.long))
            continue
        T, R, nd = item.input_ids.numel(), item.logits_indices.numel(), item.num_decode
        width = item.block_tables.shape[1] if item.block_tables is not None else 0
        chunks = item.prefill_chunks
        lora = item.lora_slots or []
        parts.append(torch.tensor([1, T, R, nd, width, item.max_context_len, len(chunks), len(lora)],
                                  dtype=torch.long))
        parts += [item.input_ids, item.positions, item.slot_mapping, item.logits_indices]
        if lora:
            parts.append(torch.tensor(lora, dtype=torch.long))
        if nd:
            parts += [item.block_tables.reshape(-1).long(), item.context_lens.long()]
        if chunks:
            parts.append(torch.tensor([v for c in chunks for v in c], dtype=torch.long))
            parts += [cs for cs in item.context_slots if cs is not None]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def decode(payload: torch.Tensor, num_lanes: int) -> list[StepInputs | None]:
    out: list[StepInputs | None] = []
    pos = 0

    def take(n: int) -> torch.Tensor:
        nonlocal pos
        chunk = payload[pos:pos + n]
        pos += n
        return chunk

    for _ in range(num_lanes):
        if int(take(1)) == 0:
            out.append(None)
            continue
        T, R, nd, width, max_ctx, C, L = take(7).tolist()
        ids, positions, slots, rows = take(T), take(T), take(T), take(R)
        lora = take(L).tolist() if L else None
        tables = lens = None
        if nd:
            tables = take(nd * width).view(nd, width).int()
            lens = take(nd).int()
        chunks: list[tuple[int, int, int]] = []
        ctx_slots: list[torch.Tensor | None] = []
        if C:
            flat = take(3 * C).tolist()
            chunks = [tuple(flat[3 * i:3 * i + 3]) for i in range(C)]
            for _, _, ctx in chunks:
                ctx_slots.append(take(ctx).clone() if ctx else None)
        out.append(StepInputs(input_ids=ids.clone(), positions=positions.clone(), slot_mapping=slots.clone(),
                              logits_indices=rows.clone(), num_decode=nd, block_tables=tables, context_lens=lens,
                              max_context_len=max_ctx, prefill_chunks=chunks, context_slots=ctx_slots,
                              lora_slots=lora))
    return out


def empty_inputs() -> StepInputs:
    """A step with no tokens: a zero3 rank without work still joins the layer gathers."""
    z = torch.zeros(0, dtype=torch.long)
    return StepInputs(input_ids=z, positions=z, slot_mapping=z, logits_indices=z)


class StepChannel:
    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    def _send_header(self, command: Command, num_lanes: int, length: int) -> None:
        self.comm.broadcast(torch.tensor([int(command), num_lanes, length, 0], dtype=torch.long))

    def send_step(self, inputs: list[StepInputs | None]) -> None:
        payload = encode(inputs)
        self._send_header(Command.STEP, len(inputs), payload.numel())
        self.comm.broadcast(payload)

    def send_cache(self, ops: CacheOps) -> None:
        payload = ops.encode()
        self._send_header(Command.CACHE, 0, payload.numel())
        self.comm.broadcast(payload)

    def send_lora(self, command: LoraCommand) -> None:
        payload = command.encode()
        self._send_header(Command.LORA, 0, payload.numel())
        self.comm.broadcast(payload)

    def send_heartbeat(self) -> None:
        self._send_header(Command.HEARTBEAT, 0, 0)

    def send_stop(self) -> None:
        self._send_header(Command.STOP, 0, 0)

    def receive(self) -> tuple[Command, list[StepInputs | None] | CacheOps | LoraCommand]:
        """The next message: a step's inputs (STEP), cache ops (CACHE), an adapter to load
        or unload (LORA), or nothing."""
        header = self.comm.broadcast(torch.zeros(HEADER, dtype=torch.long))
        command, lanes, length = Command(int(header[0])), int(header[1]), int(header[2])
        if command not in (Command.STEP, Command.CACHE, Command.LORA):
            return command, []
        payload = self.comm.broadcast(torch.zeros(length, dtype=torch.long))
        if command is Command.STEP:
            return command, decode(payload, lanes)
        return command, CacheOps.decode(payload) if command is Command.CACHE else LoraCommand.decode(payload)
