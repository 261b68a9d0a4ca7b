"""Where a process sits in its group: flags, torchrun variables, or the pod name."""

from __future__ import annotations

import pytest

from kubeshard_shard.config import Placement


def resolve(env=None, **flags):
    args = dict(strategy=None, shards=None, rank=None, master_addr=None, master_port=None, headless_service=None,
                timeout_s=30.0, offload=None)
    args.update(flags)
    return Placement.resolve(**args, env=env or {})


def test_flags_win():
    g = resolve({"RANK": "3", "WORLD_SIZE": "8"}, strategy="zero3", shards=4, rank=1, master_addr="a", master_port=1234)
    assert (g.strategy, g.shards, g.rank, g.master_addr, g.master_port) == ("zero3", 4, 1, "a", 1234)


def test_torchrun_variables():
    g = resolve({"RANK": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29600"})
    assert (g.shards, g.rank, g.master_addr, g.master_port, g.strategy) == (4, 2, "10.0.0.1", 29600, "tensor")


def test_statefulset_pod_needs_no_per_pod_configuration():
    g = resolve({"POD_NAME": "llama-g1-3"}, shards=4, headless_service="llama-g1")
    assert g.rank == 3 and g.master_addr == "llama-g1-0.llama-g1" and g.master_port == 29500


def test_bad_values_are_named():
    with pytest.raises(ValueError, match="rank 4 is outside the group of 4"):
        resolve({"POD_NAME": "x-4"}, shards=4, headless_service="x")
    with pytest.raises(ValueError, match="WORLD_SIZE must be an integer"):
        resolve({"WORLD_SIZE": "two"})
    with pytest.raises(ValueError, match="has no StatefulSet ordinal"):
        resolve({"POD_NAME": "standalone"}, shards=2, headless_service="x")
    with pytest.raises(ValueError, match="--strategy must be one of"):
        resolve(strategy="pipeline")
