"""Where our float32 GEMMs (``engine/csrc/gemm.cpp`` for a few rows, ``packed_gemm.cpp`` for
many) beat the library's.

A decode step multiplies a few rows (one per sequence, or a speculative verification's
proposals) by every weight of the model, each read once from memory. This times one
pass over all of a model's float32 linear layers, in layer order, as a step makes it
(the weights are far larger than the caches, so they stream from memory), for M rows of
input with each GEMM path, side by side and interleaved in one run: our kernel, our
packed-tile kernel, oneDNN's fused linear and ``F.linear``. The
LM head is timed apart: a step multiplies only the rows that sample by it.
``compute.small_rows`` (the most rows our kernel takes on a CPU) is chosen from these numbers.
``--against REF`` adds our kernel as it was at git revision REF, built beside today's,
to measure a change to the kernel side by side. ``--march x86-64-v3`` builds both for an
AVX2-only CPU (the path such machines take) instead of this one's own instruction set;
its results go to ``cpu-kernels-x86-64-v3.md``.

    python -m bench.cpu_gemm_bench [--models default,small] [--rows 1,2,4,8,16,32] [--reps 9] [--against REF]
                                   [--march native|x86-64-v3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import demo_model, isa_results, load_average_lines, machine, md_table, rerender, write_results
from kubeshard_shard import compute
from kubeshard_shard.checkpoints import default_model_file, local_checkpoint
from kubeshard_shard.engine import kernels
from kubeshard_shard.hardware import CpuFeatures
from kubeshard_shard.models.layers import LMHead, Linear

ROWS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]


def model_weights(model_dir) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The float32 weights of a model's linear layers in layer order, and its LM head's."""
    from bench.quantization_bench import engine

    model = engine(model_dir).engine.runner.model
    layers = [m.weight.data for m in model.modules() if isinstance(m, Linear) and not isinstance(m, LMHead)]
    return layers, model.lm_head.weight.data


def kernel_builds(against: str | None, march: str = "native") -> tuple[dict, str | None]:
    """The CPU kernels to time side by side: ``{"ours": this checkout's build}``, plus
    ``"against"``, built from git revision ``against`` when given; and that revision as
    its short hash (the revision itself, not a name like HEAD that moves on after the
    run). Exits when this checkout's kernels cannot be built."""
    built = kernels.module(march=march)
    if built is None:
        raise SystemExit("the CPU kernels could not be built: nothing to measure")
    if not against:
        return {"ours": built}, None
    rev = subprocess.run(["git", "rev-parse", "--short", against], check=True, capture_output=True,
                         text=True).stdout.strip()
    return {"ours": built, "against": kernels_at(rev, march)}, rev


def kernels_at(ref: str, march: str):
    """The CPU kernels' module as it was at git revision ``ref``, built from that
    revision's sources in a temporary folder for ``-march=<march>``."""
    repo = Path(__file__).resolve().parent.parent
    csrc = kernels.CSRC.relative_to(repo)
    # the folder goes once the module is loaded (its file stays mapped)
    with tempfile.TemporaryDirectory(prefix="kubeshard-kernels-") as temp:
        folder = Path(temp)
        for name in kernels.SOURCES + kernels.HEADERS:
            shown = subprocess.run(["git", "-C", str(repo), "show", f"{ref}:{csrc / name}"], capture_output=True,
                                   text=True)
            if shown.returncode != 0 and name in kernels.HEADERS:
                continue  # a header added since: that revision's sources do not include it
            shown.check_returncode()
            (folder / name).write_text(shown.stdout)
        return kernels.compile_extension(f"kubeshard_cpu_at_{abs(hash((ref, march)))}", folder, folder, march)


def pass_seconds(gemm, weights: list[torch.Tensor], rows: int) -> float:
    xs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in weights}}
    started = time.perf_counter()
    for w in weights:
        gemm(xs[w.shape[1]], w, None)
    return time.perf_counter() - started


def measure(weights: list[torch.Tensor], rows: list[int], reps: int, paths: dict) -> dict:
    out = {}
    for m in rows:
        times = {name: [] for name in paths}
        for gemm in paths.values():
            pass_seconds(gemm, weights, m)  # warm-up
        for _ in range(reps):  # interleaved, so a noisy moment hits every path alike
            for name, gemm in paths.items():
                times[name].append(pass_seconds(gemm, weights, m))
        out[m] = {name: statistics.median(t) * 1000 for name, t in times.items()}
        print(m, out[m], flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="default,small")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--against", help="also time our kernel as it was at this git revision")
    parser.add_argument("--march", default="native", help="the instruction set to build for (x86-64-v3: AVX2)")
    parser.add_argument("--render", action="store_true")
    args = parser.parse_args()
    results_name = isa_results("cpu-kernels") if args.march == "native" else f"cpu-kernels-{args.march}"
    if args.render:
        rerender(results_name, render)
        return
    torch.set_num_threads(os.cpu_count() or 1)
    builds, args.against = kernel_builds(args.against, args.march)
    paths = {"ours": builds["ours"].gemm_f32, "packed": builds["ours"].gemm_f32_packed,
             "onednn": compute.onednn_gemm, "F.linear": F.linear}
    if args.against:
        paths["against"] = builds["against"].gemm_f32
    rows = [int(r) for r in args.rows.split(",")]
    results = {"machine": machine(), "small_rows": compute.small_rows(CpuFeatures.detect()), "reps": args.reps,
               "models": {},
               "command": f"python -m bench.cpu_gemm_bench --models {args.models} --rows {args.rows} "
                          f"--reps {args.reps}" + (f" --against {args.against}" if args.against else "")
                          + (f" --march {args.march}" if args.march != "native" else ""),
               "against": args.against, "march": args.march,
               "load_average_1m": {"before": os.getloadavg()[0]}}
    for name in args.models.split(","):
        model_dir = local_checkpoint(default_model_file()) if name == "default" else demo_model(size=name)
        layers, head = model_weights(model_dir)
        results["models"][name] = {
            "layer_bytes": sum(w.numel() * 4 for w in layers), "head_bytes": head.numel() * 4,
            "layers": measure(layers, rows, args.reps, paths),
            "head": measure([head], [r for r in rows if r <= 8], args.reps, paths)}
        del layers, head
    results["load_average_1m"]["after"] = os.getloadavg()[0]
    write_results(results_name, results, render(results))


def _table(section: dict, against: str | None) -> list[str]:
    rows = []
    packed = all("packed" in t for t in section.values())  # results before the packed kernel have none
    for m, t in section.items():
        best = min(t["onednn"], t["F.linear"])
        row = [m, f"{t['ours']:.2f}", f"{t['onednn']:.2f}", f"{t['F.linear']:.2f}", f"{best / t['ours']:.2f}×"]
        if packed:
            row += [f"{t['packed']:.2f}", f"{best / t['packed']:.2f}×"]
        if against:
            row += [f"{t['against']:.2f}", f"{t['against'] / t['ours']:.2f}×"]
        rows.append(row)
    header = ["rows", "ours ms", "oneDNN ms", "F.linear ms", "ours vs the better library"]
    if packed:
        header += ["packed ms", "packed vs the better library"]
    if against:
        header += [f"ours at {against} ms", f"ours vs ours at {against}"]
    return md_table(header, rows, right=True)


def render(r: dict) -> str:
    m = r["machine"]
    lines = ["# The float32 small-batch GEMM against oneDNN and F.linear (CPU)", "",
             f"`{r['command']}` — {m['date']}, {m['cpu']}, {m['cores']} cores, torch {m['torch']}. Our kernels "
             f"built with `-march={r.get('march', 'native')}`"
             + (" (oneDNN and F.linear choose their instruction set at run time, this CPU's own: on an "
                "AVX2-only machine they would lose what this one's AVX-512 gives them)."
                if r.get("march", "native") != "native" else "."), "",
             "One pass over every float32 linear layer of the model, in layer order (what one step "
             "multiplies), for each number of input rows; median of the runs, the paths interleaved. "
             "*ours vs …*: the other path's time over ours (above 1×, ours is faster). "
             f"`compute.small_rows` on this CPU when this ran: {r['small_rows']} (products with at most that many rows "
             "take our kernel)." + (
                 " *packed*: our packed-tile kernel for many rows (`packed_gemm.cpp`), which takes the products "
                 "above that on CPUs whose widest vectors are AVX2 (`compute.packed_for_many_rows`)."
                 if "packed" in next(iter(next(iter(r["models"].values()))["layers"].values())) else ""), ""]
    for name, section in r["models"].items():
        lines += [f"## {name} model: the layers ({section['layer_bytes'] / 2**20:.0f} MiB)", "",
                  *_table(section["layers"], r.get("against")), "",
                  f"## {name} model: the LM head ({section['head_bytes'] / 2**20:.0f} MiB)", "",
                  *_table(section["head"], r.get("against")), ""]
    lines += load_average_lines(r)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
