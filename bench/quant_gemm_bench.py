"""How fast the integer GEMMs (``engine/csrc/gemm.cpp``: ``gemm_q8``, ``gemm_q4``) stream
a model's quantized weights, against the memory-bandwidth bound and, with ``--against
REF``, against the same kernels as they were at git revision REF, side by side.

One pass over every linear layer of the model in layer order (what one decode step
multiplies; the weights are far larger than the caches, so they stream from memory), the
layers quantized as ``--quantize`` packs them: int8 with one scale a row, int4 in groups
of 32. The LM head is left out (``cpu_gemm_bench`` times it in float32; ``--quantize
int4`` keeps it int8). *bound*: the pass's weight bytes ÷ this machine's copy bandwidth
(``quantization_bench``'s). Results go to ``quant-kernels.md`` (``-amd-avx512``, ``-avx2``:
``common.isa_results``).

    python -m bench.quant_gemm_bench [--models default,small] [--rows 1,2,4,8] [--reps 9] [--against REF]
                                     [--march native|x86-64-v3]

``--march x86-64-v3`` builds both for an AVX2 CPU (no AVX-512, no VNNI): the AVX2 kernels
measured on a machine that has more (``quant-kernels-x86-64-v3.md``). ``--levels
x86-64-v4-vnni,x86-64-v4,...`` instead times this checkout's kernels built for each of
those x86-64 levels (``engine/kernels.py``'s, the shard image's prebuilt modules) side by
side, each against the first (``quant-kernels-levels.md``, or this machine's kind's file).

    python -m bench.quant_gemm_bench --levels x86-64-v4-vnni,x86-64-v4,x86-64-v3-vnni,x86-64-v3
"""

from __future__ import annotations

import argparse
import os

import torch

from bench.common import demo_model, isa_results, load_average_lines, machine, md_table, rerender, write_results
from bench.cpu_gemm_bench import kernel_builds, measure, model_weights
from bench.quantization_bench import copy_bandwidth
from kubeshard_shard.checkpoints import default_model_file, local_checkpoint
from kubeshard_shard.engine import kernels
from kubeshard_shard.hardware import CpuFeatures
from kubeshard_shard.models import quant

INT4_GROUP = 32


class Packed:
    """One layer's packed weight, called as ``cpu_gemm_bench.measure`` calls a GEMM."""

    def __init__(self, kind: str, w: torch.Tensor) -> None:
        self.kind, self.shape = kind, w.shape
        if kind == "int8":
            self.q, self.scales = quant.quantize_q8(w, w.shape[1])
            self.mins, self.group = None, w.shape[1]
        else:
            self.q, self.scales, self.mins = quant.quantize_q4(w, INT4_GROUP)
            self.group = INT4_GROUP

    @property
    def nbytes(self) -> int:
        extra = self.scales.numel() * 2 + (self.mins.numel() * 2 if self.mins is not None else 0)
        return self.q.numel() + extra


def gemm_of(module):
    """``(x, packed, bias) -> y`` with ``module``'s integer kernels."""
    def gemm(x, p: Packed, bias):
        if p.kind == "int8":
            return module.gemm_q8(x, p.q, p.scales, p.group, bias)
        return module.gemm_q4(x, p.q, p.scales, p.mins, p.group, bias)
    return gemm


def level_builds(levels: list[str]) -> dict:
    """This checkout's kernels built for each x86-64 level (as ``kernels.prebuild`` builds
    the shard image's), by level; exits when this CPU does not run one of them."""
    flags = CpuFeatures.detect().flags
    needs = dict(kernels.LEVELS)
    builds = {}
    for level in levels:
        if level not in needs:
            raise SystemExit(f"--levels: {level!r} is not one of {', '.join(needs)}")
        if not needs[level] <= flags:
            lacks = ", ".join(sorted(needs[level] - flags))
            raise SystemExit(f"--levels: this CPU does not run {level} (it lacks {lacks})")
        builds[level] = kernels.module(march=level)
        if builds[level] is None:
            raise SystemExit(f"the CPU kernels could not be built for {level}")
    return builds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="default,small")
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--against", help="also time the kernels as they were at this git revision")
    parser.add_argument("--march", default="native", help="the instruction set to build for (x86-64-v3: AVX2)")
    parser.add_argument("--levels", help="time builds for these x86-64 levels side by side instead")
    parser.add_argument("--render", action="store_true")
    args = parser.parse_args()
    results_name = (isa_results("quant-kernels-levels") if args.levels
                    else isa_results("quant-kernels") if args.march == "native" else f"quant-kernels-{args.march}")
    if args.render:
        rerender(results_name, render)
        return
    torch.set_num_threads(os.cpu_count() or 1)
    if args.levels:
        builds = level_builds(args.levels.split(","))
    else:
        builds, args.against = kernel_builds(args.against, args.march)
    paths = {name: gemm_of(module) for name, module in builds.items()}
    rows = [int(r) for r in args.rows.split(",")]
    bandwidth = copy_bandwidth()
    results = {"machine": machine(), "copy_bandwidth_gb_s": bandwidth / 1e9, "reps": args.reps, "models": {},
               "command": f"python -m bench.quant_gemm_bench --models {args.models} --rows {args.rows} "
                          f"--reps {args.reps}" + (f" --against {args.against}" if args.against else "")
                          + (f" --march {args.march}" if args.march != "native" else "")
                          + (f" --levels {args.levels}" if args.levels else ""),
               "against": args.against, "march": args.march, "levels": list(builds) if args.levels else None,
               "load_average_1m": {"before": os.getloadavg()[0]}}
    for name in args.models.split(","):
        model_dir = local_checkpoint(default_model_file()) if name == "default" else demo_model(size=name)
        layers, _ = model_weights(model_dir)
        section = {}
        for kind in ("int8", "int4"):
            packed = [Packed(kind, w) for w in layers]
            nbytes = sum(p.nbytes for p in packed)
            section[kind] = {"weight_bytes": nbytes, "bound_ms": nbytes / bandwidth * 1000,
                             "times": measure(packed, rows, args.reps, paths)}
            del packed
        results["models"][name] = section
        del layers
    results["load_average_1m"]["after"] = os.getloadavg()[0]
    write_results(results_name, results, render(results))


def render(r: dict) -> str:
    m, against = r["machine"], r.get("against")
    lines = ["# The integer GEMMs against the memory bound (CPU)", "",
             f"`{r['command']}` — {m['date']}, {m['cpu']}, {m['cores']} cores, torch {m['torch']}. "
             f"Copy bandwidth: {r['copy_bandwidth_gb_s']:.1f} GB/s."
             + (f" Kernels built with `-march={r['march']}`." if r.get("march", "native") != "native" else ""), "",
             "One pass over every linear layer of the model but the LM head, quantized (int8: a scale a row; "
             f"int4: groups of {INT4_GROUP}), in layer order; median of the runs, the paths interleaved. "
             "*× bound*: the pass's time over its weight bytes ÷ copy bandwidth."
             + (f" *ours at {against}*: the same kernels built from that revision, in the same run." if against
                else ""), ""]
    levels = r.get("levels")
    if levels:
        lines[-2] += (f" One build of this checkout's kernels per x86-64 level ({', '.join(levels)}), each flagged "
                      f"as `engine/kernels.py` builds the shard image's; *speed-up*: the level's time over "
                      f"{levels[0]}'s.")
    for name, section in r["models"].items():
        for kind, t in section.items():
            if levels:
                header = ["rows"] + [f"{level} ms (× bound)" for level in levels]
                header += [f"{levels[0]} speed-up over {level}" for level in levels[1:]]
                rows = [[m_rows] + [f"{times[level]:.2f} ({times[level] / t['bound_ms']:.2f})" for level in levels]
                        + [f"{times[level] / times[levels[0]]:.2f}×" for level in levels[1:]]
                        for m_rows, times in t["times"].items()]
                lines += [f"## {name} model, {kind} ({t['weight_bytes'] / 2**20:.1f} MiB, bound "
                          f"{t['bound_ms']:.2f} ms)", "", *md_table(header, rows, right=True), ""]
                continue
            header = ["rows", "ours ms", "GB/s", "× bound"]
            if against:
                header += [f"ours at {against} ms", f"× bound at {against}", "speed-up"]
            rows = []
            for m_rows, times in t["times"].items():
                ours = times["ours"]
                row = [m_rows, f"{ours:.2f}", f"{t['weight_bytes'] / ours / 1e6:.1f}", f"{ours / t['bound_ms']:.2f}"]
                if against:
                    row += [f"{times['against']:.2f}", f"{times['against'] / t['bound_ms']:.2f}",
                            f"{times['against'] / ours:.2f}×"]
                rows.append(row)
            lines += [f"## {name} model, {kind} ({t['weight_bytes'] / 2**20:.1f} MiB, bound "
                      f"{t['bound_ms']:.2f} ms)", "", *md_table(header, rows, right=True), ""]
    lines += load_average_lines(r)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
