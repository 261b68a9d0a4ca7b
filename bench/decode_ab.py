"""Batch-1 decode with this checkout's CPU kernels against the same kernels as they were at
git revision REF, both engines in one process, side by side.

Why in one process: on the shared machines here the memory a process gets, and the
bandwidth it reads at, move from one process to the next. Timing a change by running
whole processes in turn (this checkout's, then REF's, five times) once favoured a kernel
change that this harness then measured at 0.98x. Here both engines are loaded at once
(REF's kernels built by ``cpu_gemm_bench.kernels_at``), and each prompt's greedy decode
runs on one, then on the other, the order alternating every round; a round's speed-up
is REF's time over ours for the same prompt.

    python -m bench.decode_ab --against REF [--quantize none|int8|int4|gguf] [--model default|small]
                              [--rounds 4] [--tokens 64]

Only the kernels differ: the Python engine is this checkout's for both. Against a
revision whose kernels are this checkout's, the figures show the harness's own noise.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from bench.common import demo_model, isa_results, load_average_lines, machine, md_table, rerender, write_results
from bench.cpu_gemm_bench import kernels_at
from bench.quantization_bench import PROMPTS, decode_run, engine, first_difference, prompt_ids
from kubeshard_shard import compute
from kubeshard_shard.checkpoints import default_model_file, local_checkpoint

METHODS = ("none", "int8", "int4", "gguf")


def engine_with(built, model_dir, quantize: str):
    """An engine whose CPU kernels are the module ``built`` (compute.plan takes the
    module from ``kernels.module``; it is swapped only while this engine is built)."""
    real = compute.kernels.module
    compute.kernels.module = lambda *args, **kwargs: built
    try:
        return engine(model_dir, quantize=quantize, enable_prefix_caching=False)
    finally:
        compute.kernels.module = real


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.decode_ab")
    parser.add_argument("--against", help="the git revision whose kernels ours are measured against")
    parser.add_argument("--quantize", default="int4", choices=METHODS)
    parser.add_argument("--model", default="default", choices=("default", "small"))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--render", action="store_true")
    args = parser.parse_args()
    name = isa_results("decode-ab")
    if args.render:
        rerender(name, render)
        return
    if not args.against:
        parser.error("--against REF is required (a git revision)")
    if args.rounds < 1 or args.tokens < 2:
        parser.error(f"--rounds must be at least 1 and --tokens at least 2, got {args.rounds} and {args.tokens}")
    if args.quantize == "gguf" and args.model != "default":
        parser.error("--quantize gguf needs --model default (the demo models are not GGUF conversions)")
    torch.set_num_threads(os.cpu_count() or 1)
    results = {"machine": machine(), "against": args.against, "quantize": args.quantize, "model": args.model,
               "tokens": args.tokens, "rounds": args.rounds,
               "command": f"python -m bench.decode_ab --against {args.against} --quantize {args.quantize} "
                          f"--model {args.model} --rounds {args.rounds} --tokens {args.tokens}",
               "load_average_1m": {"before": os.getloadavg()[0]}}
    model_dir = local_checkpoint(default_model_file()) if args.model == "default" else demo_model(size=args.model)
    prompts = [prompt_ids(model_dir, text) for text in PROMPTS]
    served = {"ours": engine(model_dir, quantize=args.quantize, enable_prefix_caching=False),
              "ref": engine_with(kernels_at(args.against, "native"), model_dir, args.quantize)}
    if served["ours"].engine.runner.fused is None or served["ref"].engine.runner.fused is None:
        raise SystemExit(f"--quantize {args.quantize}: the fused decode step does not serve this model here")
    answers = {}
    for key, s in served.items():
        answers[key] = [decode_run(s, [p], args.tokens)[0][0] for p in prompts]  # also the warm-up
    times: dict[str, list[float]] = {"ours": [], "ref": []}
    for rnd in range(args.rounds):
        for p in prompts:
            for key in ("ours", "ref") if rnd % 2 == 0 else ("ref", "ours"):
                times[key].append(statistics.median(decode_run(served[key], [p], args.tokens)[1]) * 1000)
        print(f"round {rnd}: ours {statistics.median(times['ours']):.3f} ms, "
              f"ref {statistics.median(times['ref']):.3f} ms", flush=True)
    ratios = [r / o for r, o in zip(times["ref"], times["ours"])]
    results.update(ms_per_token=times, speedups=ratios, same_answers=answers["ours"] == answers["ref"],
                   first_differing_token=[first_difference(x, y) for x, y in zip(answers["ours"], answers["ref"])])
    results["load_average_1m"]["after"] = os.getloadavg()[0]
    write_results(name, results, render(results))


def render(r: dict) -> str:
    m = r["machine"]
    ours, ref, ratios = r["ms_per_token"]["ours"], r["ms_per_token"]["ref"], r["speedups"]
    diff = ", ".join("—" if d is None else str(d) for d in r["first_differing_token"])
    lines = [
        "# Batch-1 decode: this checkout's CPU kernels against a revision's, in one process", "",
        f"`{r['command']}` — {m['date']}, {m['cpu']}, {m['cores']} cores, torch {m['torch']}.", "",
        f"The {r['model']} model, weights `{r['quantize']}`, greedy, {r['tokens']} tokens of each of "
        f"{len(PROMPTS)} chat prompts a round, {r['rounds']} rounds; both engines loaded at once, each prompt "
        "decoded on one then the other (the order alternating by round). *ms/token*: the median over every "
        "decode of the median step time; *speed-up*: the revision's time over ours, per decode.", "",
        *md_table(["kernels", "ms/token", "speed-up (median, lowest–highest)"], [
            ["ours", f"{statistics.median(ours):.3f}",
             f"{statistics.median(ratios):.3f}× ({min(ratios):.3f}–{max(ratios):.3f})"],
            [f"at {r['against']}", f"{statistics.median(ref):.3f}", ""]], right=True, left=(0,)), "",
        f"Greedy answers the same: {'yes' if r['same_answers'] else 'no'} (first differing token per prompt: "
        f"{diff}).", "",
        *load_average_lines(r), "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
