"""A member of a shard group: the leader serves and drives, the others follow.

All ranks: join the process group (workers wait for their leader), check that they
agree on strategy, model and engine settings, load only their share of the weights,
agree on the KV pool size, then meet at a barrier — only then does the leader's health
turn SERVING. The leader runs the engine and sends every step to its ranks; a
follower executes the steps it receives until the leader says stop. Any failed or
timed-out collective ends the process with a non-zero status: a process group cannot
take back one rank, so the group restarts as a whole.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass

import torch

from kubeshard_shard.config import DistributedConfig, EngineConfig
from kubeshard_shard.distributed.comm import Comm, GroupError, check_agreement, fingerprint, init_group
from kubeshard_shard.distributed.step_channel import Command, StepChannel, empty_inputs
from kubeshard_shard.distributed.tensor_parallel import apply_tensor_parallel, check_divisible, local_kv_heads
from kubeshard_shard.distributed.zero3 import Zero3
from kubeshard_shard.engine import kernels
from kubeshard_shard.engine.factory import ServedModel, build_served_model, resolve_device
from kubeshard_shard.models.config import CheckpointError, load_model_config
from kubeshard_shard.server.grpc_service import GroupInfo
from kubeshard_shard.server.serve import HealthServer, ListenConfig, install_signal_handlers, run_leader

log = logging.getLogger(__name__)


@dataclass
class Member:
    served: ServedModel
    comm: Comm
    channel: StepChannel
    strategy: str


def _engine_fingerprint(config: EngineConfig) -> int:
    fields = (config.dtype, config.max_input_tokens, config.max_total_tokens, config.block_size,
              config.max_batch_tokens)
    return fingerprint(repr(fields).encode())


def load_member(config: EngineConfig, group: DistributedConfig) -> Member:
    device = resolve_device(config.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", group.rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    model_config = load_model_config(config.model_dir)  # fails fast, before joining
    if device.type == "cpu":
        kernels.load()  # a first build takes a while: not inside a collective's timeout
    if group.strategy == "tensor":
        check_divisible(model_config, group.world_size)
    comm = init_group(group, device)
    check_agreement(comm, group.strategy, fingerprint((config.model_dir / "config.json").read_bytes()),
                    _engine_fingerprint(config))
    channel = StepChannel(comm)
    if group.strategy == "tensor":
        served = build_served_model(config, strategy_pass=lambda m: apply_tensor_parallel(m, comm),
                                    num_kv_heads=local_kv_heads(model_config, comm.rank, comm.world_size)[1],
                                    device=device, agree_blocks=comm.min_int)
        resident = served.rank_parameter_bytes[0]
    else:
        zero3 = Zero3(comm, offload=group.offload)
        served = build_served_model(config, strategy_pass=zero3.apply, load_weights_fn=zero3.load, device=device,
                                    num_streams=group.world_size, agree_blocks=comm.min_int)
        resident = zero3.resident_bytes()
    served.rank_parameter_bytes = [row[0] for row in comm.all_gather_ints([resident])]
    comm.barrier()  # every rank has loaded
    log.info("rank %d loaded (%s strategy, %d parameter bytes resident)", comm.rank, group.strategy, resident)
    return Member(served, comm, channel, group.strategy)


def _zero3_rows(inputs) -> list[int]:
    return [0 if x is None else x.logits_indices.numel() for x in inputs]


def leader_execute(member: Member):
    runner, comm, channel = member.served.engine.runner, member.comm, member.channel

    if member.strategy == "tensor":
        def execute(inputs):
            channel.send_step(inputs)
            return [runner.run(inputs[0])]
        return execute

    def execute(inputs):
        channel.send_step(inputs)
        logits = runner.run(inputs[0] or empty_inputs())
        rows = _zero3_rows(inputs)
        if max(rows) == 0:
            return [None] * len(inputs)
        gathered = comm.gather_rows(logits, rows)
        return [g if x is not None else None for g, x in zip(gathered, inputs)]
    return execute


def follow(member: Member, should_stop) -> int:
    """A follower's loop: execute each step the leader sends until it says stop (or,
    after SIGTERM, until the drain deadline passes without the leader's stop)."""
    runner, comm, channel = member.served.engine.runner, member.comm, member.channel
    while True:
        if should_stop():
            log.warning("rank %d: the leader did not stop the group in time; exiting", comm.rank)
            return 0
        command, inputs = channel.receive()
        if command is Command.STOP:
            log.info("rank %d: the leader stopped the group", comm.rank)
            return 0
        if command is Command.HEARTBEAT:
            continue
        if member.strategy == "tensor":
            runner.run(inputs[0])
        else:
            logits = runner.run(inputs[comm.rank] or empty_inputs())
            rows = _zero3_rows(inputs)
            if max(rows):
                comm.gather_rows(logits, rows)


def run_group_member(config: EngineConfig, group: DistributedConfig, listen: ListenConfig) -> int:
    try:
        if group.rank == 0:
            code = _run_leader(config, group, listen)
        else:
            code = _run_follower(config, group, listen)
    except GroupError as exc:
        log.error("%s", exc)
        code = 1
    except CheckpointError as exc:
        print(f"kubeshard: cannot load the model: {exc}", file=sys.stderr)
        code = 1
    except ValueError as exc:
        print(f"kubeshard serve-shard: error: {exc}", file=sys.stderr)
        code = 2
    # gloo's threads may still wait on a dead peer; leave now with the status we chose
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_leader(config: EngineConfig, group: DistributedConfig, listen: ListenConfig) -> int:
    def load() -> ServedModel:
        member = load_member(config, group)
        member.served.engine.execute = leader_execute(member)
        member.served.engine.comm_seconds = lambda: member.comm.comm_seconds
        member.served.on_idle = member.channel.send_heartbeat
        member.served.on_stop = member.channel.send_stop
        return member.served

    try:
        return run_leader(config.model_id, config.revision, GroupInfo(group.strategy, group.world_size), listen,
                          load)
    except GroupError as exc:
        log.error("%s", exc)
        return 1


def _run_follower(config: EngineConfig, group: DistributedConfig, listen: ListenConfig) -> int:
    """Loads and follows in the main thread (the compute path; see engine.async_engine)
    while a second thread serves grpc.health.v1 for the pod's probes."""
    stop_at: list[float] = []
    install_signal_handlers(lambda: stop_at or stop_at.append(time.monotonic() + listen.drain_seconds))
    health = HealthServer(listen)
    health.start()
    log.info("rank %d health on %s:%d", group.rank, listen.host, health.port)
    try:
        member = load_member(config, group)
        health.set(True)
        print(f"kubeshard shard ready: rank {group.rank} of {group.world_size} following "
              f"{group.master_addr}:{group.master_port}", flush=True)
        return follow(member, lambda: bool(stop_at) and time.monotonic() > stop_at[0])
    except (GroupError, CheckpointError, ValueError):
        raise
    except Exception as exc:  # a failed collective: the group is broken
        log.error("rank %d: shard group failed: %s", group.rank, exc)
        return 1
    finally:
        health.close()
