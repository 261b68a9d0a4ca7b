"""``kubeshard serve-shard``: one process of a shard group, leader or follower.

A group of one is a plain model server. In a larger group every rank resolves its
compute plan (building the decode kernel, which takes a while the first time) before it
joins the process group (workers wait for their leader), checks that the ranks agree on
strategy, model and engine settings, loads only its share of the weights, agrees on
the KV pool size, then meets the others at a barrier — only then does the leader's
health turn SERVING. The leader runs the engine, whose strategy sends every step to
the ranks; a follower executes the steps it receives until the leader says stop. Any
failed or timed-out collective ends the process with a non-zero status: a process
group cannot take back one rank, so the group restarts as a whole.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from kubeshard_shard.compute import resolve_compute
from kubeshard_shard.config import EngineConfig, ListenConfig, Placement
from kubeshard_shard.distributed.comm import GroupError, check_agreement, fingerprint, init_group
from kubeshard_shard.distributed.strategy import make_strategy
from kubeshard_shard.models.config import CheckpointError, load_model_config
from kubeshard_shard.server.factory import ServedModel, build_served_model
from kubeshard_shard.server.grpc_service import GroupInfo
from kubeshard_shard.server.heap import freeze_startup_heap
from kubeshard_shard.server.serve import HealthServer, install_signal_handlers, run_leader

log = logging.getLogger(__name__)


def engine_fingerprint(config: EngineConfig) -> int:
    """The engine settings every rank of a group must share: what a step computes and
    how (precision, limits, weight quantization, KV pool type, CPU GEMM library, the LoRA
    adapters in their slots)."""
    lora = (config.lora_adapters, config.max_loras, config.max_lora_rank) if config.lora_on else ()
    fields = (config.dtype, config.max_input_tokens, config.max_total_tokens, config.block_size,
              config.max_batch_tokens, config.activations.active, config.quantize, config.quantize_group_size,
              config.kv_cache_dtype, config.cpu_gemm) + lora
    return fingerprint(repr(fields).encode())


def load_member(config: EngineConfig, placement: Placement) -> ServedModel:
    """Joins the group and loads this rank's share; returns once every rank has loaded."""
    model_config = load_model_config(config.model_dir)  # fails fast, before joining
    strategy = make_strategy(placement)
    strategy.check(model_config)  # sizes that do not divide, too
    compute = resolve_compute(config, model_config, placement)
    if placement.shards > 1:
        comm = init_group(placement, compute.device)
        check_agreement(comm, placement.strategy, fingerprint((config.model_dir / "config.json").read_bytes()),
                        engine_fingerprint(config))
        strategy.join(comm)
    served = build_served_model(config, strategy, compute)
    freeze_startup_heap()
    if placement.shards > 1:
        comm.barrier()  # every rank has loaded
        log.info("rank %d loaded (%s strategy, %d parameter bytes resident)", placement.rank, placement.strategy,
                 served.rank_parameter_bytes[placement.rank])
    return served


def run_shard(config: EngineConfig, placement: Placement, listen: ListenConfig) -> int:
    if placement.shards == 1:
        return _run_leader(config, placement, listen)
    try:
        code = _run_leader(config, placement, listen) if placement.is_leader else \
            _run_follower(config, placement, listen)
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


def _run_leader(config: EngineConfig, placement: Placement, listen: ListenConfig) -> int:
    group = GroupInfo(placement.strategy, placement.shards)
    try:
        return run_leader(config.model_id, config.revision, group, listen, lambda: load_member(config, placement))
    except GroupError as exc:
        log.error("%s", exc)
        return 1


def _run_follower(config: EngineConfig, placement: Placement, listen: ListenConfig) -> int:
    """Loads and follows in the main thread (the compute path; see engine.async_engine)
    while a second thread serves grpc.health.v1 for the pod's probes."""
    stop_at: list[float] = []
    install_signal_handlers(lambda: stop_at or stop_at.append(time.monotonic() + listen.drain_seconds))
    health = HealthServer(listen)
    health.start()
    log.info("rank %d health on %s:%d", placement.rank, listen.host, health.port)
    try:
        served = load_member(config, placement)
        health.set(True)
        print(f"kubeshard shard ready: rank {placement.rank} of {placement.shards} following "
              f"{placement.master_addr}:{placement.master_port}", flush=True)
        return served.strategy.follow(served.engine.runner,
                                      lambda: bool(stop_at) and time.monotonic() > stop_at[0], served.cache_worker)
    except (GroupError, CheckpointError, ValueError):
        raise
    except Exception as exc:  # a failed collective: the group is broken
        log.error("rank %d: shard group failed: %s", placement.rank, exc)
        return 1
    finally:
        health.close()
