"""Weight-only quantization and compressed KV pools on CPU, in-process, side by side.

1. Batch-1 decode: time per token and weight bytes for float32, int8, int4 (and the
   GGUF file's own Q4_1/Q8_0 kept quantized, ``gguf``) on the default model and the
   ``small`` demo model, against each one's memory-bandwidth bound: weight bytes read per
   token ÷ this machine's copy bandwidth (a decode step must read every weight once),
   measured beside each prompt's decode: the bandwidth a shared machine gives moves by a
   quarter within minutes, and a bound taken once at the start would move every ratio
   with it. Every method's engine is loaded at once and the prompts decoded in rounds,
   the methods in turn (``--rounds``; medians over them), so that a drift over minutes
   moves every method alike. Resident memory of the process after loading each one,
   greedy agreement with float32 (the first differing token of each answer), and the
   same decode with the fused decode step off, side by side.
2. KV pools: tokens that fit in the same memory, decode time at batch 16 over a long
   context, and greedy agreement, for float32, bfloat16 and int8 pools.

    python -m bench.quantization_bench [--tokens 64] [--models default,small] [--rounds 3]
                                       [--march native|x86-64-v3]

``--march x86-64-v3`` serves every engine with the kernels built for an AVX2 CPU (no
AVX-512, no VNNI; built ahead as the shard image builds them, ``kernels.prebuild``): the
AVX2 paths measured end to end on a machine that has more (``quantization-x86-64-v3.md``).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from pathlib import Path

import psutil
import torch

from bench.common import demo_model, isa_results, load_average_lines, machine, rerender, write_results
from kubeshard_shard.checkpoints import default_model_file, local_checkpoint
from kubeshard_shard.config import EngineConfig, MemoryBudget
from kubeshard_shard.engine import kernels
from kubeshard_shard.engine.attention import KVCache
from kubeshard_shard.engine.request import make_sampling_params
from kubeshard_shard.server.factory import build_served_model

PROMPTS = ["What is the capital of France?", "Explain why the sky is blue.", "Write a haiku about the sea.",
           "How many legs does a spider have?"]


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Bytes per second of a large tensor copy (read + write, STREAM's convention)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        started = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - started)
    return 2 * nbytes / best


def weight_bytes(model) -> int:
    """Bytes of the parameters a decode step reads (the embedding table is only indexed,
    one row per token, unless it is also the LM head)."""
    total = 0
    tied = model.config.tie_word_embeddings
    for name, p in model.named_parameters():
        if "embed_tokens" in name and not tied:
            continue
        total += p.numel() * p.element_size()
    return total


def engine(model_dir, **overrides):
    config = EngineConfig(model_dir=model_dir, model_id=model_dir.name, max_total_tokens=2048,
                          kv_cache_memory=MemoryBudget.parse(overrides.pop("kv", "256MiB")), **overrides)
    return build_served_model(config)


def prompt_ids(model_dir, text: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def decode_run(served, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], list[float]]:
    """Greedy answers (EOS ignored) and the time of every decode-only step."""
    eng = served.engine
    outs = {eng.add_request(str(i), p, make_sampling_params(max_new_tokens=tokens, ignore_eos=True)): i
            for i, p in enumerate(prompts)}
    answers: list[list[int]] = [[] for _ in prompts]
    steps = []
    while eng.has_work():
        prefilling = any(s.num_computed_tokens < s.num_prompt_tokens for lane in eng.lanes
                         for s in lane.scheduler.running) or any(lane.scheduler.waiting for lane in eng.lanes)
        started = time.perf_counter()
        for o in eng.step():
            answers[outs[o.request_key]].append(o.token_id)
        if not prefilling:
            steps.append(time.perf_counter() - started)
    return answers, steps


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def weights_section(name: str, model_dir, methods: list[str], tokens: int, rounds: int) -> dict:
    """Every method's engine loaded at once, then ``rounds`` rounds of the prompts' decodes
    (each method in turn within a round), so that the machine's drift over minutes moves
    every method alike: a row's figures are medians over the rounds, its ratio to the
    bound the median of the rounds' ratios."""
    served, rss = {}, {}
    prompts = [prompt_ids(model_dir, t) for t in PROMPTS]
    for method in methods:
        gc.collect()
        rss_before = psutil.Process().memory_info().rss
        # no prefix caching: a later round would find its prompts cached and prefill only
        # their tails, in other shapes, whose last bits can move a near-tie in a greedy answer
        served[method] = engine(model_dir, quantize=method, enable_prefix_caching=False)
        rss[method] = psutil.Process().memory_info().rss - rss_before
        decode_run(served[method], prompts[:1], 8)  # warm-up
    samples: dict[str, list[dict]] = {method: [] for method in methods}
    answers: dict[str, list[list[int]]] = {}
    for _ in range(rounds):
        for method in methods:
            per_token, modules, bandwidths, mine = [], [], [], []
            runner = served[method].engine.runner
            fused = runner.fused
            for p in prompts:
                bandwidths.append(copy_bandwidth(256 << 20, reps=3))  # the bound of this moment
                a, steps = decode_run(served[method], [p], tokens)
                mine.append(a[0])
                per_token.append(statistics.median(steps))
                if fused is not None:  # the same answer through the modules, side by side
                    runner.fused = None
                    modules.append(statistics.median(decode_run(served[method], [p], tokens)[1]))
                    runner.fused = fused
            if answers.setdefault(method, mine) != mine:  # greedy: every round the same tokens
                raise RuntimeError(f"{name} {method}: a round's greedy answers differ from the first round's")
            wb = weight_bytes(runner.model)
            ms, bandwidth = statistics.median(per_token) * 1000, statistics.median(bandwidths)
            samples[method].append({"decode_ms_per_token": ms, "weight_bytes": wb,
                                    "bound_ms": wb / bandwidth * 1000, "over_bound": ms / (wb / bandwidth * 1000),
                                    "modules_ms_per_token": statistics.median(modules) * 1000 if modules else None,
                                    "copy_bandwidth_gb_s": bandwidth / 1e9})
            print(name, method, samples[method][-1], flush=True)
    rows = {}
    reference = answers[methods[0]]
    for method in methods:
        runs = samples[method]
        row = {k: statistics.median(run[k] for run in runs) if runs[0][k] is not None else None for k in runs[0]}
        row["weight_bytes"] = runs[0]["weight_bytes"]
        row.update(rss_delta_bytes=rss[method], rounds=runs,
                   first_differing_token=[first_difference(r, a) for r, a in zip(reference, answers[method])])
        rows[method] = row
    served.clear()
    return rows


def kv_section(model_dir, tokens: int, context: int) -> dict:
    rows = {}
    reference = None
    budget = "160MiB"
    for kv_dtype in ("float32", "bfloat16", "int8"):
        gc.collect()
        served = engine(model_dir, kv=budget, kv_cache_dtype=kv_dtype, max_num_seqs=16)
        cache = served.engine.runner.cache
        capacity = served.num_kv_blocks * cache.block_size
        gen = torch.Generator().manual_seed(0)
        vocab = served.model_config.vocab_size
        prompts = [torch.randint(5, vocab, (context,), generator=gen).tolist() for _ in range(16)]
        per_seq = (context + tokens) * 16
        if per_seq > capacity:  # the batch must fit without preemption to time decode alone
            prompts = prompts[:max(1, capacity // (context + tokens))]
        decode_run(served, prompts[:1], 4)
        answers, steps = decode_run(served, prompts, tokens)
        if reference is None:
            reference = answers
        rows[kv_dtype] = {"tokens_in_budget": capacity, "budget": budget,
                          "bytes_per_token": KVCache.bytes_per_block(cache.num_layers, cache.block_size,
                                                                     cache.num_kv_heads, cache.head_dim,
                                                                     cache.dtype) // cache.block_size,
                          "batch": len(prompts), "context": context,
                          "decode_ms_per_step": statistics.median(steps) * 1000,
                          "first_differing_token": [first_difference(r, a) for r, a in zip(reference, answers)]}
        print("kv", kv_dtype, rows[kv_dtype], flush=True)
        del served
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--models", default="default,small")
    parser.add_argument("--rounds", type=int, default=3,
                        help="decode rounds over every method, interleaved (figures are medians over them)")
    parser.add_argument("--march", default="native",
                        help="the instruction set the kernels are built for (x86-64-v3: AVX2)")
    parser.add_argument("--render", action="store_true")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    results_name = isa_results("quantization") if args.march == "native" else f"quantization-{args.march}"
    if args.render:
        rerender(results_name, render)
        return
    if args.march == "native":
        measure(args, results_name)
        return
    if args.march not in dict(kernels.LEVELS):
        parser.error(f"--march must be native or one of {', '.join(dict(kernels.LEVELS))}, got {args.march}")
    with tempfile.TemporaryDirectory(prefix="kubeshard-kernels-") as folder:
        kernels.prebuild(Path(folder), (args.march,))
        os.environ[kernels.PREBUILT_ENV] = folder  # the only level there: every engine loads it
        measure(args, results_name)


def measure(args: argparse.Namespace, results_name: str) -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    bandwidth = copy_bandwidth()
    results = {"machine": machine(), "copy_bandwidth_gb_s": bandwidth / 1e9, "tokens": args.tokens, "models": {},
               "rounds": args.rounds,
               "command": f"python -m bench.quantization_bench --tokens {args.tokens} --models {args.models} "
                          f"--rounds {args.rounds}" + (f" --march {args.march}" if args.march != "native" else ""),
               "march": args.march,
               "load_average_1m": {"before": os.getloadavg()[0]}}
    for name in args.models.split(","):
        if name == "default":
            model_dir, methods = local_checkpoint(default_model_file()), ["none", "int8", "int4", "gguf"]
        else:
            model_dir, methods = demo_model(size=name), ["none", "int8", "int4"]
        results["models"][name] = {"weights": weights_section(name, model_dir, methods, args.tokens, args.rounds)}
        write_results(results_name, results, render(results))
    results["kv"] = kv_section(local_checkpoint(default_model_file()) if "default" in args.models
                               else demo_model(size="small"), 32, 1000)
    results["load_average_1m"]["after"] = os.getloadavg()[0]
    write_results(results_name, results, render(results))


def render(r: dict) -> str:
    m = r["machine"]
    beside = any("copy_bandwidth_gb_s" in row for s in r["models"].values() for row in s["weights"].values())
    bound = ("copy bandwidth, measured right before each prompt's decode (256 MiB, best of 3; *copy GB/s*: the median "
             "of a row's samples)" if beside else "the copy bandwidth at the start")
    lines = ["# Weight-only quantization and compressed KV pools (CPU)", "",
             f"`{r['command']}` — {m['date']}, {m['cpu']}, {m['cores']} cores, torch {m['torch']}. "
             f"Copy bandwidth at the start: {r['copy_bandwidth_gb_s']:.1f} GB/s (read + write of a 1 GiB tensor, best "
             "of 5)." + (f" Kernels built with `-march={r['march']}` (what a CPU with just that instruction set runs; "
                         "on this one's memory)." if r.get("march", "native") != "native" else ""), "",
             "Batch-1 greedy decode, in-process (no gRPC or HTTP), median step time over "
             f"{r['tokens']} tokens of each of {len(PROMPTS)} chat prompts. *bound*: weight bytes a step reads ÷ "
             f"{bound}. *first differing token*: where each answer departs from float32's (— : never, "
             "within the tokens generated). *modules*: the same decode with the fused decode step off "
             "(every layer through its Python modules), each prompt right after its fused run.", ""]
    if r.get("rounds", 1) > 1:
        lines += [f"Every engine loaded at once and the prompts decoded in {r['rounds']} rounds, the methods in turn "
                  "within each: a row's figures are the medians over the rounds (*× bound*: the median of the "
                  "rounds' ratios; *range*: the lowest and highest of them).", ""]
    for name, section in r["models"].items():
        lines += [f"## {name} model", "",
                  "| weights | decode ms/token | weight bytes | copy GB/s | bound ms | × bound (range) "
                  "| modules ms/token | RSS after load | first differing token |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        for method, row in section["weights"].items():
            copy = row.get("copy_bandwidth_gb_s", r["copy_bandwidth_gb_s"])
            diff = ", ".join("—" if d is None else str(d) for d in row["first_differing_token"])
            modules = row.get("modules_ms_per_token")
            modules = "—" if modules is None else f"{modules:.2f} ({modules / row['decode_ms_per_token']:.2f}×)"
            spread = ""
            if len(row.get("rounds", [])) > 1:
                ratios = [run["over_bound"] for run in row["rounds"]]
                spread = f" ({min(ratios):.2f}–{max(ratios):.2f})"
            lines.append(f"| {'float32' if method == 'none' else method} | {row['decode_ms_per_token']:.2f} | "
                         f"{row['weight_bytes'] / 2**20:.1f} MiB | {copy:.1f} | {row['bound_ms']:.2f} | "
                         f"{row['over_bound']:.2f}{spread} | "
                         f"{modules} | {row['rss_delta_bytes'] / 2**20:.0f} MiB | {diff} |")
        lines.append("")
    if "kv" in r:
        lines += ["## KV pool types (same memory budget)", "",
                  "| KV pool | bytes per token | tokens in budget | batch × context | decode ms/step | first differing "
                  "token |", "|---|---:|---:|---|---:|---|"]
        for kv, row in r["kv"].items():
            diff = ", ".join("—" if d is None else str(d) for d in row["first_differing_token"])
            lines.append(f"| {kv} | {row['bytes_per_token']} | {row['tokens_in_budget']} ({row['budget']}) | "
                         f"{row['batch']} × {row['context']} | {row['decode_ms_per_step']:.1f} | {diff} |")
        lines.append("")
    lines += load_average_lines(r)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
