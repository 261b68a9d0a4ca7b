"""A candidate int4 weight layout (``bench/q4_x16.cpp``: W's rows in groups of 16, each
block's 16 rows interleaved so that one byte dot product gives 16 rows' sums in their own
lanes) against the engine's int4 GEMM (``gemm_q4``, GGUF's row-major layout), side by
side on the same weights: one pass over the model's linear layers but the LM head, int4
in groups of 32, as ``quant_gemm_bench`` times them; the two kernels in turn, medians.

Why: the int4 decode step on AMD Zen 4 stayed at 1.6x its memory bound (the target is
1.5x) while int8 reached 1.24x: the engine's int4 kernel spends more per row on scales,
minimums and sums across lanes than on its byte dot products (``csrc/gemm.cpp``,
q4_rows512), and the x16 layout has no per-row work. Measured here before the engine
takes the layout (a new weight format through quantization, sharding, the fused decode
step and dequantization). Needs AVX-512 VNNI. Each pass's outputs are checked against the
engine's (the same exact integer dots; only float rounding differs).

    python -m bench.q4_layout_bench [--models default] [--rows 1,2,4] [--reps 15]
"""

from __future__ import annotations

import argparse
import hashlib
import os
from pathlib import Path

import torch

from bench.common import demo_model, isa_results, load_average_lines, machine, md_table, rerender, write_results
from bench.cpu_gemm_bench import measure, model_weights
from bench.quant_gemm_bench import Packed, gemm_of
from bench.quantization_bench import copy_bandwidth
from kubeshard_shard.checkpoints import default_model_file, local_checkpoint
from kubeshard_shard.engine import kernels
from kubeshard_shard.hardware import CpuFeatures
from kubeshard_shard.paths import cache_root

SOURCE = Path(__file__).with_name("q4_x16.cpp")
NEEDS = frozenset({"avx512f", "avx512bw", "avx512_vnni"})  # as /proc/cpuinfo names them


def prototype():
    """``bench/q4_x16.cpp`` built with the engine kernels' flags for this CPU."""
    from torch.utils.cpp_extension import load

    key = hashlib.sha256((SOURCE.read_text() + torch.__version__).encode()).hexdigest()[:16]
    build = cache_root() / "kernels" / f"bench_q4_x16_{key}"
    build.mkdir(parents=True, exist_ok=True)
    return load(name=f"q4_x16_{key}", sources=[str(SOURCE)], extra_cflags=kernels._cflags("native"),
                extra_ldflags=kernels.LDFLAGS, build_directory=str(build), verbose=False)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.q4_layout_bench")
    parser.add_argument("--models", default="default")
    parser.add_argument("--rows", default="1,2,4")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--render", action="store_true")
    args = parser.parse_args()
    name = isa_results("q4-layout")
    if args.render:
        rerender(name, render)
        return
    lacks = NEEDS - CpuFeatures.detect().flags
    if lacks:  # `make bench` runs every benchmark: not a failure there
        print(f"bench.q4_layout_bench: the x16 prototype needs {', '.join(sorted(lacks))}, which this CPU lacks; "
              "nothing measured")
        return
    torch.set_num_threads(os.cpu_count() or 1)
    engine_kernels, x16 = kernels.module(), prototype()
    engine_gemm = gemm_of(engine_kernels)
    bandwidth = copy_bandwidth()
    results = {"machine": machine(), "copy_bandwidth_gb_s": bandwidth / 1e9, "reps": args.reps, "models": {},
               "command": f"python -m bench.q4_layout_bench --models {args.models} --rows {args.rows} "
                          f"--reps {args.reps}",
               "load_average_1m": {"before": os.getloadavg()[0]}}
    for model in args.models.split(","):
        model_dir = local_checkpoint(default_model_file()) if model == "default" else demo_model(size=model)
        layers, _ = model_weights(model_dir)
        packed = [Packed("int4", w) for w in layers]
        del layers
        for p in packed:
            p.x16 = x16.repack(p.q, p.scales, p.mins)
        worst = 0.0
        for p in packed:  # the same products, to float rounding
            x = torch.randn(3, p.shape[1])
            want = engine_gemm(x, p, None)
            worst = max(worst, ((x16.gemm(x, p.x16) - want).abs().max() / want.abs().max()).item())
        if worst > 1e-5:
            raise SystemExit(f"{model}: the x16 kernel's products differ from the engine's by {worst:.2e} "
                             "of their scale")
        nbytes = sum(p.nbytes for p in packed)
        paths = {"engine": engine_gemm, "x16": lambda x, p, bias: x16.gemm(x, p.x16)}
        results["models"][model] = {"weight_bytes": nbytes, "bound_ms": nbytes / bandwidth * 1000,
                                    "largest_difference": worst,
                                    "times": measure(packed, [int(r) for r in args.rows.split(",")], args.reps, paths)}
    results["load_average_1m"]["after"] = os.getloadavg()[0]
    write_results(name, results, render(results))


def render(r: dict) -> str:
    m = r["machine"]
    lines = ["# int4: the x16 layout (prototype) against the engine's kernel", "",
             f"`{r['command']}` — {m['date']}, {m['cpu']}, {m['cores']} cores, torch {m['torch']}. "
             f"Copy bandwidth: {r['copy_bandwidth_gb_s']:.1f} GB/s.", "",
             "One pass over every linear layer of the model but the LM head, int4 in groups of 32, the two kernels "
             "in turn (median of the passes; a Python call a layer in both). *engine*: `gemm_q4` on GGUF's row-major "
             "layout; *x16*: `bench/q4_x16.cpp`. *× bound*: the pass's time over its weight bytes ÷ copy bandwidth. "
             "*largest difference*: of the two kernels' outputs, relative to their scale.", ""]
    for model, s in r["models"].items():
        rows = [[rows_x, f"{t['engine']:.2f}", f"{t['engine'] / s['bound_ms']:.2f}", f"{t['x16']:.2f}",
                 f"{t['x16'] / s['bound_ms']:.2f}", f"{t['engine'] / t['x16']:.2f}×"]
                for rows_x, t in s["times"].items()]
        lines += [f"## {model} model ({s['weight_bytes'] / 2**20:.1f} MiB, bound {s['bound_ms']:.2f} ms; largest "
                  f"difference {s['largest_difference']:.1e})", "",
                  *md_table(["rows of x", "engine ms", "× bound", "x16 ms", "× bound", "x16 speed-up"], rows,
                            right=True), ""]
    lines += load_average_lines(r)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
