"""The CPU kernels a decode step runs besides its GEMMs — paged decode attention
(``engine/csrc/paged_decode.cpp``) and SwiGLU (``silu_mul``) — against torch's own ops and,
with ``--against REF``, against the same kernels as they were at git revision REF,
built beside today's and timed interleaved in one run.

Shapes of the default model (SmolLM2-135M: 9 query heads, 3 KV heads of 64, intermediate
1536), float32, the KV cache's blocks scattered over the pool as a long-running server
leaves them. Results go to ``decode-kernels.md`` (``-amd-avx512``, ``-avx2``: ``common.isa_results``).

    python -m bench.decode_kernel_bench [--contexts 64,512,2048] [--batches 1,16] [--reps 200] [--against REF]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from bench.common import isa_results, load_average_lines, machine, md_table, rerender, write_results
from bench.cpu_gemm_bench import kernel_builds
from kubeshard_shard.engine.attention import decode_attention_reference

HQ, HKV, D, BLOCK, INTERMEDIATE = 9, 3, 64, 16, 1536


def per_call_us(fn, reps: int) -> float:
    for _ in range(5):
        fn()
    started = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - started) / reps * 1e6


def interleaved(paths: dict, reps: int, rounds: int = 5) -> dict:
    """Median over ``rounds`` of each path's time per call, the paths taking turns."""
    times = {name: [] for name in paths}
    for _ in range(rounds):
        for name, fn in paths.items():
            times[name].append(per_call_us(fn, reps))
    return {name: statistics.median(t) for name, t in times.items()}


def attention_paths(modules: dict, batch: int, context: int) -> dict:
    gen = torch.Generator().manual_seed(batch * 10_000 + context)
    blocks_each = -(-context // BLOCK)
    pool = batch * blocks_each + 8
    k_cache = torch.randn(pool * BLOCK, HKV, D, generator=gen)
    v_cache = torch.randn(pool * BLOCK, HKV, D, generator=gen)
    tables = torch.randperm(pool, generator=gen)[:batch * blocks_each].to(torch.int32).reshape(batch, blocks_each)
    lens = torch.full((batch,), context, dtype=torch.int32)
    q = torch.randn(batch, HQ, D, generator=gen)
    out = torch.empty_like(q)
    scale = D ** -0.5
    paths = {name: (lambda m=m: m.paged_decode(out, q, k_cache, v_cache, tables, lens, BLOCK, scale))
             for name, m in modules.items()}
    paths["torch"] = lambda: decode_attention_reference(q, k_cache, v_cache, tables, lens, context, BLOCK, scale)
    return paths


def swiglu_paths(modules: dict, rows: int) -> dict:
    gate_up = torch.randn(rows, 2 * INTERMEDIATE)
    paths = {name: (lambda m=m: m.silu_mul(gate_up)) for name, m in modules.items()}
    paths["torch"] = lambda: F.silu(gate_up[:, :INTERMEDIATE]) * gate_up[:, INTERMEDIATE:]
    return paths


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", default="64,512,2048")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--against", help="also time the kernels as they were at this git revision")
    parser.add_argument("--render", action="store_true")
    args = parser.parse_args()
    results_name = isa_results("decode-kernels")
    if args.render:
        rerender(results_name, render)
        return
    torch.set_num_threads(os.cpu_count() or 1)
    modules, args.against = kernel_builds(args.against)
    results = {"machine": machine(), "reps": args.reps, "against": args.against,
               "command": f"python -m bench.decode_kernel_bench --contexts {args.contexts} --batches {args.batches} "
                          f"--reps {args.reps}" + (f" --against {args.against}" if args.against else ""),
               "load_average_1m": {"before": os.getloadavg()[0]}, "attention": [], "swiglu": []}
    batches = [int(b) for b in args.batches.split(",")]
    for batch in batches:
        for context in (int(c) for c in args.contexts.split(",")):
            row = {"batch": batch, "context": context, **interleaved(attention_paths(modules, batch, context), args.reps)}
            print(row, flush=True)
            results["attention"].append(row)
        row = {"rows": batch, **interleaved(swiglu_paths(modules, batch), args.reps * 5)}
        print(row, flush=True)
        results["swiglu"].append(row)
    results["load_average_1m"]["after"] = os.getloadavg()[0]
    write_results(results_name, results, render(results))


def _cells(row: dict, against: str | None) -> list[str]:
    cells = [f"{row['ours']:.1f}", f"{row['torch']:.1f}", f"{row['torch'] / row['ours']:.2f}×"]
    if against:
        cells += [f"{row['against']:.1f}", f"{row['against'] / row['ours']:.2f}×"]
    return cells


def render(r: dict) -> str:
    m, against = r["machine"], r.get("against")
    extra = [f"ours at {against} µs", f"ours vs ours at {against}"] if against else []
    lines = ["# Decode attention and SwiGLU kernels (CPU)", "",
             f"`{r['command']}` — {m['date']}, {m['cpu']}, {m['cores']} cores, torch {m['torch']}.", "",
             f"The default model's shapes ({HQ} query heads, {HKV} KV heads of {D}, intermediate {INTERMEDIATE}), "
             "float32, µs per call (median of 5 rounds, the paths taking turns). *torch*: the engine's torch "
             "reference (`decode_attention_reference`; `F.silu(gate) * up`). *vs …*: the other path's time over "
             "ours (above 1×, ours is faster)."
             + (f" *ours at {against}*: the same kernels built from that revision, in the same run." if against
                else ""), "",
             "## Paged decode attention", "",
             *md_table(["batch", "context", "ours µs", "torch µs", "ours vs torch", *extra],
                       [[row["batch"], row["context"], *_cells(row, against)] for row in r["attention"]], right=True),
             "", "## SwiGLU (silu_mul)", "",
             *md_table(["rows", "ours µs", "torch µs", "ours vs torch", *extra],
                       [[row["rows"], *_cells(row, against)] for row in r["swiglu"]], right=True), ""]
    lines += load_average_lines(r)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
