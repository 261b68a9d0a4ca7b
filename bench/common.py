"""Helpers shared by the benchmarks: memory, machine facts, workloads, result files.

Processes and ports come from the tests' own helpers (``tests.support``)."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from kubeshard_shard.hardware import CpuFeatures
from kubeshard_shard.paths import cache_root

RESULTS = Path(__file__).resolve().parent / "results"
CACHE = cache_root()


SIMD_FLAGS = ("fma", "f16c", "avx", "avx2", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
              "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def cpuinfo_field(key: str) -> str:
    """The first value of ``key`` in /proc/cpuinfo (``model name``, ``vendor_id``), or ""."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == key:
                return value.strip()
    except OSError:
        pass
    return ""


def cpu_model() -> str:
    """The CPU's model name and the SIMD flags the kernels and torch choose paths by
    (machines here differ: one had AVX-512 with BF16, another only AVX2), e.g.
    ``AMD EPYC (fma f16c avx avx2 avx512f ...)``."""
    flags = CpuFeatures.detect().flags
    return f"{cpuinfo_field('model name') or 'unknown'} ({' '.join(f for f in SIMD_FLAGS if f in flags) or 'no AVX'})"


def isa_results(name: str) -> str:
    """The results file of a CPU-speed benchmark for this machine's instruction set:
    ``name`` on an Intel CPU with AVX-512, ``name-amd-avx512`` on an AMD one (Zen 4
    runs a 512-bit instruction as two 256-bit halves: its kernels rank differently),
    ``name-avx2`` on one with AVX2 but not AVX-512, ``name-x86-64`` below that. The
    machines here change from day to day; each kind keeps its own latest run instead of
    one overwriting the other."""
    flags = CpuFeatures.detect().flags
    if "avx512f" in flags:
        return f"{name}-amd-avx512" if cpuinfo_field("vendor_id") == "AuthenticAMD" else name
    return f"{name}-avx2" if "avx2" in flags else f"{name}-x86-64"


def machine() -> dict:
    import torch

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


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


def kubeshard(*args: str) -> list[str]:
    return [sys.executable, "-m", "kubeshard_shard.cli", *args]


def write_results(name: str, data: dict, markdown: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(markdown)
    print(markdown)


def md_table(header: list[str], rows, right: bool = False, left: tuple[int, ...] = ()) -> list[str]:
    """A Markdown table's lines: the header, its rule, one line a row (each cell as
    ``str``). ``right``: columns align right, but those whose index is in ``left``."""
    rule = "|" + "".join("---:|" if right and i not in left else "---|" for i in range(len(header)))
    return ["| " + " | ".join(header) + " |", rule, *("| " + " | ".join(map(str, row)) + " |" for row in rows)]


def load_average_lines(r: dict) -> list[str]:
    """The results' 1-minute load average before and after the run, as Markdown lines
    (none when the run did not finish)."""
    la = r.get("load_average_1m", {})
    if "after" not in la:
        return []
    return [f"1-minute load average: {la['before']:.1f} before, {la['after']:.1f} after (2 cores)."]


def rerender(name: str, render) -> None:
    """A benchmark's ``--render``: rewrites ``results/<name>.md`` from its ``.json`` with
    ``render(data)``, running nothing."""
    data = json.loads((RESULTS / f"{name}.json").read_text())
    write_results(name, data, render(data))


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
