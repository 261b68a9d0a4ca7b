"""Start a real ``kubeshard serve-shard`` process for tests and wait until it serves."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import grpc

from kubeshard_proto import pb, pb_grpc
from tests.support.redis_server import free_port

READY = re.compile(r"kubeshard shard ready: model (?P<model>\S+) on (?P<host>[^:\s]+):(?P<port>\d+)")


@dataclass
class ShardProcess:
    proc: subprocess.Popen
    address: str
    metrics_port: int | None
    lines: list[str] = field(default_factory=list)

    def stub(self) -> pb_grpc.TextGenerationStub:
        channel = grpc.insecure_channel(self.address)
        return pb_grpc.TextGenerationStub(channel)

    def stats(self) -> pb.StatsResponse:
        return self.stub().Stats(pb.StatsRequest(), timeout=10)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def _pump(proc: subprocess.Popen, lines: list[str], ready: threading.Event, found: dict) -> None:
    for line in proc.stdout:
        lines.append(line)
        m = READY.search(line)
        if m and not ready.is_set():
            found.update(m.groupdict())
            ready.set()
    ready.set()


def shard_command(model_dir, *flags: str, port: int = 0, metrics_port: int | None = None) -> list[str]:
    return [sys.executable, "-m", "kubeshard_shard.cli", "serve-shard", "--model", str(model_dir),
            "--host", "127.0.0.1", "--port", str(port),
            "--metrics-host", "127.0.0.1", "--metrics-port", str(metrics_port or 0), *flags]


def start_shard(model_dir, *flags: str, port: int = 0, metrics: bool = False, timeout: float = 180,
                env: dict | None = None, wait: bool = True) -> ShardProcess:
    metrics_port = free_port() if metrics else None
    proc = subprocess.Popen(shard_command(model_dir, *flags, port=port, metrics_port=metrics_port),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            env={**os.environ, **(env or {})})
    lines: list[str] = []
    ready, found = threading.Event(), {}
    threading.Thread(target=_pump, args=(proc, lines, ready, found), daemon=True).start()
    shard = ShardProcess(proc, "", metrics_port, lines)
    if not wait:
        return shard
    if not ready.wait(timeout) or not found:
        proc.kill()
        raise AssertionError(f"serve-shard did not become ready within {timeout}s:\n{''.join(lines)[-4000:]}")
    shard.address = f"127.0.0.1:{found['port']}"
    return shard


def wait_exit(proc: subprocess.Popen, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return proc.returncode
        time.sleep(0.1)
    raise AssertionError(f"process {proc.pid} still running after {timeout}s")


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
