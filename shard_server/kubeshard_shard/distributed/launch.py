"""``kubeshard serve-shard``: one process of a shard group.

A group of one is a plain model server. Larger groups join a torch.distributed process
group: rank 0 serves gRPC and drives the steps, the other ranks follow it
(``distributed.group``).
"""

from __future__ import annotations

import logging

from kubeshard_shard.distributed.rendezvous import resolve_group
from kubeshard_shard.engine.factory import build_served_model
from kubeshard_shard.server.grpc_service import GroupInfo
from kubeshard_shard.server.serve import ListenConfig, run_leader

log = logging.getLogger(__name__)


def listen_config(args) -> ListenConfig:
    return ListenConfig(host=args.host, port=args.port, metrics_host=args.metrics_host,
                        metrics_port=args.metrics_port or None, drain_seconds=args.drain_seconds)


def run_shard(args) -> int:
    from kubeshard_shard.cli import engine_config

    config = engine_config(args)
    group = resolve_group(args.strategy, args.shards, args.rank, args.master_addr, args.master_port,
                          args.headless_service, args.dist_timeout, args.offload)
    if group.world_size > 1:
        from kubeshard_shard.distributed.group import run_group_member

        return run_group_member(config, group, listen_config(args))
    return run_leader(config.model_id, config.revision, GroupInfo(group.strategy, 1), listen_config(args),
                      lambda: build_served_model(config))
