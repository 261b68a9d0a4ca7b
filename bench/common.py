"""Helpers shared by the benchmarks: processes, ports, memory, result files."""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
CACHE = Path(os.environ.get("KUBESHARD_CACHE", Path.home() / ".cache" / "kubeshard"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine() -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def peak_rss_bytes(pid: int) -> int:
    """VmHWM of a live process (peak resident set)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def self_peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


class Proc:
    """A child process whose output is collected; ``wait_for`` waits for a line."""

    def __init__(self, argv: list[str], env: dict | None = None) -> None:
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                     env={**os.environ, **(env or {})}, start_new_session=True)
        self.lines: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, pattern: str, timeout: float = 600) -> re.Match:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            while seen < len(self.lines):
                m = rx.search(self.lines[seen])
                seen += 1
                if m:
                    return m
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.proc.args[:4]} exited ({self.proc.returncode}):\n{''.join(self.lines)[-3000:]}")
            time.sleep(0.05)
        raise TimeoutError(f"no line matching {pattern!r} within {timeout}s:\n{''.join(self.lines)[-3000:]}")

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def kubeshard(*args: str) -> list[str]:
    return [sys.executable, "-m", "kubeshard_shard.cli", *args]


def write_results(name: str, data: dict, markdown: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(markdown)
    print(markdown)


def demo_model(arch: str = "llama", size: str = "small") -> Path:
    from kubeshard_shard.demo_model import cached_demo_model

    return cached_demo_model(CACHE / "demo-models", arch=arch, size=size, seed=0)


def grpc_request(ids: list[int], new_tokens: int):
    from kubeshard_proto import pb

    return pb.GenerateRequest(request_id="bench", input_ids=ids, sampling=pb.SamplingParameters(),
                              stopping=pb.StoppingCriteria(max_new_tokens=new_tokens, ignore_eos=True))


async def grpc_workload(address: str, prompts: list[list[int]], new_tokens: int,
                        warm_prompts: list[list[int]] | None = None) -> dict:
    """Over gRPC, greedy, EOS ignored: batch-1 decode time per token (one request alone),
    then ``warm_prompts`` sent at once, unmeasured (the server's first touch of its KV
    pool pages and oneDNN's first build of each GEMM shape are start-up costs, not
    throughput; they are other prompts, so nothing measured comes from the prefix
    cache), then every prompt at once: output tokens/s of the latter."""
    import grpc

    from kubeshard_proto import pb_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        async for _ in stub.Generate(grpc_request(prompts[0], 4)):
            pass
        stamps = []
        async for _ in stub.Generate(grpc_request(prompts[1], new_tokens)):
            stamps.append(time.perf_counter())
        tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1)

        async def one(p):
            n = 0
            async for _ in stub.Generate(grpc_request(p, new_tokens)):
                n += 1
            return n

        import asyncio

        if warm_prompts:
            await asyncio.gather(*(one(p) for p in warm_prompts))
        started = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - started
    return {"tok_s": sum(counts) / wall, "wall_s": wall, "tpot_1_ms": tpot * 1000}
