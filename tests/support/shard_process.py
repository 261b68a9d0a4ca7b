"""Real ``kubeshard serve-shard`` processes and shard groups for tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass

import grpc

from kubeshard_proto import pb, pb_grpc
from tests.support.ports import free_port
from tests.support.processes import Proc, start, wait_exit

__all__ = ["ShardProcess", "ShardGroup", "start_shard", "start_group", "wait_exit", "shard_command"]

READY = re.compile(r"kubeshard shard ready: model (?P<model>\S+) on (?P<host>[^:\s]+):(?P<port>\d+)")


@dataclass
class ShardProcess:
    """A ``kubeshard serve-shard`` process (any rank) and how to talk to it."""

    p: Proc
    metrics_port: int | None

    @property
    def proc(self) -> subprocess.Popen:
        return self.p.proc

    @property
    def address(self) -> str:
        return self.p.address if self.p.match else ""

    @property
    def output(self) -> str:
        return self.p.output

    def stub(self) -> pb_grpc.TextGenerationStub:
        return pb_grpc.TextGenerationStub(grpc.insecure_channel(self.address))

    def stats(self) -> pb.StatsResponse:
        return self.stub().Stats(pb.StatsRequest(), timeout=10)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        return self.p.stop(sig, timeout)


def shard_command(model_dir, *flags: str, port: int = 0, metrics_port: int | None = None) -> list[str]:
    return [sys.executable, "-m", "kubeshard_shard.cli", "serve-shard", "--model", str(model_dir),
            "--host", "127.0.0.1", "--port", str(port),
            "--metrics-host", "127.0.0.1", "--metrics-port", str(metrics_port or 0), *flags]


def start_shard(model_dir, *flags: str, port: int = 0, metrics: bool = False, timeout: float = 180,
                env: dict | None = None, wait: bool = True) -> ShardProcess:
    """Starts serve-shard; with ``wait``, returns once the leader serves (raises
    AssertionError with its output otherwise)."""
    metrics_port = free_port() if metrics else None
    cmd = shard_command(model_dir, *flags, port=port, metrics_port=metrics_port)
    try:
        p = start("serve-shard", cmd, READY, timeout=timeout, env=env, wait=wait)
    except RuntimeError as exc:
        raise AssertionError(str(exc)) from None
    return ShardProcess(p, metrics_port)


@dataclass
class ShardGroup:
    leader: ShardProcess
    followers: list[ShardProcess]
    master_port: int

    @property
    def members(self) -> list[ShardProcess]:
        return [self.leader, *self.followers]

    def stop(self) -> None:
        for member in self.members:
            member.stop()


def start_group(model_dir, strategy: str, shards: int, *flags: str, port: int = 0, master_port: int | None = None,
                timeout: float = 240, follower_flags: dict[int, list[str]] | None = None) -> ShardGroup:
    """Starts ranks 1..N-1 then the leader, each its own process, and waits for the leader."""
    master_port = master_port or free_port()
    common = ["--strategy", strategy, "--shards", str(shards), "--master-addr", "127.0.0.1",
              "--master-port", str(master_port), "--num-threads", "1", *flags]
    if os.environ.get("KUBESHARD_TEST_DEVICE"):  # bench/cuda_check.py runs these on GPUs
        common += ["--device", os.environ["KUBESHARD_TEST_DEVICE"]]
    followers = [start_shard(model_dir, *common, "--rank", str(r), *(follower_flags or {}).get(r, []), wait=False)
                 for r in range(1, shards)]
    try:
        leader = start_shard(model_dir, *common, "--rank", "0", port=port, timeout=timeout)
    except AssertionError as exc:
        for f in followers:
            f.stop()
        logs = "\n".join(f"--- rank {i + 1}:\n{f.output[-2000:]}" for i, f in enumerate(followers))
        raise AssertionError(f"{exc}\n{logs}") from None
    return ShardGroup(leader, followers, master_port)
