"""A sharding strategy: one object that says how a process of a group computes.

The model code holds no strategy. A strategy is handed to the engine at construction
and answers every question that depends on it:

- before joining its peers: ``check`` the model's sizes; then ``join`` the group's
  communicator;
- what it can serve: ``check_quantize`` (a weight quantization), a ValueError naming the
  flag when it cannot;
- while loading: ``apply`` a pass over the model on the
  meta device, ``load_weights`` of this rank's share, ``kv_heads`` this rank keeps
  (``splits_kv_heads``: a slice of them, so its KV blocks are its own),
  ``lanes`` (per-rank schedulers) the leader drives, ``agree_blocks`` on one KV pool size;
- per engine step on the leader: ``execute`` the step's inputs (one per lane), sending
  them to the other ranks first; on a follower: ``follow`` the leader's steps;
- around the loop: ``heartbeat`` while idle, ``stop`` at the end, ``comm_seconds``;
- for the activation cache: ``exchange_cache`` hands the leader's ``CacheOps`` to every
  rank's cache worker and gathers their answers (a follower answers in ``follow``);
  ``lora_command`` does the same with a runtime LoRA adapter load or unload.

``Single`` is a group of one. ``Tensor`` keeps each rank's slice of every weight (one
lane; the leader samples). ``Zero3`` keeps 1/N of every layer's parameters and
gathers a layer just before use; every rank runs its own lane (data parallel).
"""

from __future__ import annotations

import logging
from typing import Callable, Protocol

import torch

from kubeshard_shard.activations.ops import COUNTERS, NOT_MINE, CacheOps
from kubeshard_shard.activations.worker import CacheWorker
from kubeshard_shard.config import Placement
from kubeshard_shard.distributed.comm import Comm
from kubeshard_shard.distributed.step_channel import Command, StepChannel, empty_inputs
from kubeshard_shard.distributed.tensor_parallel import apply_tensor_parallel, check_divisible, local_kv_heads
from kubeshard_shard.distributed.zero3 import Zero3Partitions
from kubeshard_shard.engine.model_runner import ModelRunner, StepInputs
from kubeshard_shard.models.config import ModelConfig
from kubeshard_shard.models.loader import SafetensorsCheckpoint, load_weights
from kubeshard_shard.models.lora import LoraCommand

log = logging.getLogger(__name__)

Logits = list[torch.Tensor | None]


class Strategy(Protocol):
    name: str
    shards: int
    rank: int
    lanes: int
    splits_kv_heads: bool

    def check(self, model_config: ModelConfig) -> None: ...
    def check_quantize(self, method: str) -> None: ...
    def join(self, comm: Comm) -> None: ...
    def apply(self, model) -> None: ...
    def load_weights(self, model, checkpoint: SafetensorsCheckpoint) -> None: ...
    def kv_heads(self, model_config: ModelConfig) -> int: ...
    def agree_blocks(self, num_blocks: int) -> int: ...
    def parameter_bytes(self, model) -> list[int]: ...
    def execute(self, runner: ModelRunner, inputs: list[StepInputs | None]) -> Logits: ...
    def follow(self, runner: ModelRunner, should_stop: Callable[[], bool], cache: CacheWorker | None = None) -> int: ...
    def exchange_cache(self, ops: CacheOps, worker: CacheWorker) -> list[list[int]]: ...
    def lora_command(self, command: LoraCommand, row: list[int]) -> list[list[int]]: ...
    def heartbeat(self) -> None: ...
    def stop(self) -> None: ...

    @property
    def comm_seconds(self) -> float: ...


def _resident(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class Single:
    """A group of one process: the whole model, one lane, nobody to talk to."""

    shards, rank, lanes = 1, 0, 1
    splits_kv_heads = False
    comm_seconds = 0.0

    def __init__(self, name: str = "tensor") -> None:
        self.name = name  # what Info reports: the strategy asked for, over one shard

    def check(self, model_config: ModelConfig) -> None:
        pass

    def check_quantize(self, method: str) -> None:
        pass

    def join(self, comm: Comm) -> None:
        raise RuntimeError("a group of one has no peers to join")

    def apply(self, model) -> None:
        pass

    def load_weights(self, model, checkpoint: SafetensorsCheckpoint) -> None:
        load_weights(model, checkpoint)

    def kv_heads(self, model_config: ModelConfig) -> int:
        return model_config.num_key_value_heads

    def agree_blocks(self, num_blocks: int) -> int:
        return num_blocks

    def parameter_bytes(self, model) -> list[int]:
        return [_resident(model)]

    def execute(self, runner: ModelRunner, inputs: list[StepInputs | None]) -> Logits:
        return [runner.run(inputs[0])]

    def follow(self, runner: ModelRunner, should_stop: Callable[[], bool], cache: CacheWorker | None = None) -> int:
        raise RuntimeError("a group of one has no leader to follow")

    def exchange_cache(self, ops: CacheOps, worker: CacheWorker) -> list[list[int]]:
        return [worker.apply(ops)]

    def lora_command(self, command: LoraCommand, row: list[int]) -> list[list[int]]:
        return [row]

    def heartbeat(self) -> None:
        pass

    def stop(self) -> None:
        pass


class _Group:
    """What the strategies of a real group share: the step channel to the followers,
    the pool-size agreement, heartbeats and the follower's loop. ``run_step`` is the
    strategy's own math, the same on every rank."""

    name = ""

    def __init__(self, placement: Placement) -> None:
        self.shards, self.rank = placement.shards, placement.rank
        self.comm: Comm | None = None
        self.channel: StepChannel | None = None

    def join(self, comm: Comm) -> None:
        self.comm, self.channel = comm, StepChannel(comm)

    def check_quantize(self, method: str) -> None:
        pass  # each rank packs its own slice

    @property
    def comm_seconds(self) -> float:
        return self.comm.comm_seconds

    def run_step(self, runner: ModelRunner, inputs: list[StepInputs | None]) -> Logits:
        raise NotImplementedError

    def execute(self, runner: ModelRunner, inputs: list[StepInputs | None]) -> Logits:
        self.channel.send_step(inputs)
        return self.run_step(runner, inputs)

    def follow(self, runner: ModelRunner, should_stop: Callable[[], bool], cache: CacheWorker | None = None) -> int:
        """Executes each step the leader sends until it says stop (or, after SIGTERM,
        until the drain deadline passes without the leader's stop); answers cache ops
        with ``cache``, this rank's activation-cache worker."""
        while True:
            if should_stop():
                log.warning("rank %d: the leader did not stop the group in time; exiting", self.rank)
                return 0
            command, payload = self.channel.receive()
            if command is Command.STOP:
                log.info("rank %d: the leader stopped the group", self.rank)
                return 0
            if command is Command.STEP:
                self.run_step(runner, payload)
            elif command is Command.CACHE:
                row = cache.apply(payload) if cache is not None else \
                    [0] * len(COUNTERS) + [NOT_MINE] * len(payload.queries)
                self.comm.all_gather_row(row)
            elif command is Command.LORA:
                self.comm.all_gather_row(runner.lora.apply(payload) if runner.lora is not None else [0, 0],
                                         patient=True)

    def exchange_cache(self, ops: CacheOps, worker: CacheWorker) -> list[list[int]]:
        self.channel.send_cache(ops)
        return self.comm.all_gather_row(worker.apply(ops))

    def lora_command(self, command: LoraCommand, row: list[int]) -> list[list[int]]:
        """Sends the other ranks a runtime adapter load or unload; every rank's answer
        (``AdapterRegistry.apply``), the leader's ``row`` first."""
        self.channel.send_lora(command)
        return self.comm.all_gather_row(row, patient=True)

    def heartbeat(self) -> None:
        self.channel.send_heartbeat()

    def stop(self) -> None:
        self.channel.send_stop()

    def agree_blocks(self, num_blocks: int) -> int:
        return self.comm.min_int(num_blocks)

    def parameter_bytes(self, model) -> list[int]:
        return [row[0] for row in self.comm.all_gather_ints([self.resident_bytes(model)])]

    def resident_bytes(self, model) -> int:
        return _resident(model)


class Tensor(_Group):
    name, lanes = "tensor", 1
    splits_kv_heads = True

    def check(self, model_config: ModelConfig) -> None:
        check_divisible(model_config, self.shards)

    def apply(self, model) -> None:
        apply_tensor_parallel(model, self.comm)

    def load_weights(self, model, checkpoint: SafetensorsCheckpoint) -> None:
        load_weights(model, checkpoint)  # each parallel layer reads only its slice

    def kv_heads(self, model_config: ModelConfig) -> int:
        return local_kv_heads(model_config, self.rank, self.shards)[1]

    def run_step(self, runner: ModelRunner, inputs: list[StepInputs | None]) -> Logits:
        return [runner.run(inputs[0])]  # followers' logits are empty: only the leader samples


class Zero3(_Group):
    name = "zero3"
    splits_kv_heads = False  # every rank keeps every KV head of its own lane's sequences

    def __init__(self, placement: Placement) -> None:
        super().__init__(placement)
        self.lanes = placement.shards
        self.offload = placement.offload
        self.partitions: Zero3Partitions | None = None

    def join(self, comm: Comm) -> None:
        super().join(comm)
        self.partitions = Zero3Partitions(comm, offload=self.offload)

    def check(self, model_config: ModelConfig) -> None:
        pass  # flat partitions are padded: any size splits

    def check_quantize(self, method: str) -> None:
        raise ValueError(f"--quantize {method} is not available with --strategy zero3: its flat partitions hold "
                         "one float dtype; use --strategy tensor (each rank packs its slice)")

    def apply(self, model) -> None:
        self.partitions.apply(model)

    def load_weights(self, model, checkpoint: SafetensorsCheckpoint) -> None:
        self.partitions.load(model, checkpoint)

    def kv_heads(self, model_config: ModelConfig) -> int:
        return model_config.num_key_value_heads

    def resident_bytes(self, model) -> int:
        return self.partitions.resident_bytes()

    def run_step(self, runner: ModelRunner, inputs: list[StepInputs | None]) -> Logits:
        """Every rank runs its own lane's inputs (or none: it still joins the layer
        gathers); the leader gathers every lane's logits."""
        logits = runner.run(inputs[self.rank] or empty_inputs())
        rows = [0 if x is None else x.logits_indices.numel() for x in inputs]
        if max(rows) == 0:
            return [None] * len(inputs)
        gathered = self.comm.gather_rows(logits, rows)
        if gathered is None:
            return [None] * len(inputs)
        return [g if x is not None else None for g, x in zip(gathered, inputs)]


STRATEGIES: dict[str, type[_Group]] = {"tensor": Tensor, "zero3": Zero3}


def make_strategy(placement: Placement) -> Strategy:
    """The strategy of a process: ``Single`` in a group of one, else by name (not yet
    joined: ``check`` works now, ``join`` once the communicator exists)."""
    if placement.shards == 1:
        return Single(placement.strategy)
    return STRATEGIES[placement.strategy](placement)
