"""Speculative decoding on the default model (SmolLM2-135M-Instruct, float32): output
tokens/s at 1 and 8 clients with and without it, on prompts whose answers copy from
the prompt (fixing, renaming, extracting, quoting) and on free chat; the acceptance
figures come from the server's own vllm:spec_decode_* metrics.

Each configuration is one `kubeshard serve-shard` process (gRPC, the router adds the
same ~1 ms to every one); prompts go through the model's chat template; greedy, at most
``--max-tokens`` output tokens, each answer ending at its EOS or the limit. Greedy
output is the same with and without speculation (the tests show it token for token),
so every configuration generates the very same tokens here and only the time differs.

``--rounds N`` starts every configuration's server at once and runs each workload N
times on each, interleaved, in turn forward and backward (none, ngram, ngram, none, ...):
the speeds are medians and a speed-up the median of each round's ratio, so a drift of the
machine falls on both sides of it (``speculative-rounds*.md``). This machine's speed
moved 10-25% within minutes, as much as the gaps measured, when each round was a
server run of a minute or more after the other's.

    python -m bench.speculative_bench [--max-tokens 128] [--configs none,ngram,ngram-min1,ngram-pause4,draft-int4]
                                      [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import requests

from bench.common import isa_results, machine, percentile, rerender, write_results
from kubeshard_proto import pb
from kubeshard_shard.checkpoints import default_model_file, local_checkpoint
from tests.support.shard_process import start_shard

CONFIGS = {
    "none": [],
    "ngram": ["--speculative", "ngram", "--num-speculative-tokens", "6", "--speculative-ngram-min", "2",
              "--speculative-ngram-max", "4"],
    # down to one-token matches: a step with no longer match still proposes, at most two
    # tokens after a one-token match (engine/ngram.py)
    "ngram-min1": ["--speculative", "ngram", "--num-speculative-tokens", "6", "--speculative-ngram-min", "1",
                   "--speculative-ngram-max", "4"],
    # the same as ngram, paused while 4 or more sequences run (at 8 clients most steps decode plainly)
    "ngram-pause4": ["--speculative", "ngram", "--num-speculative-tokens", "6", "--speculative-ngram-min", "2",
                     "--speculative-ngram-max", "4", "--speculative-disable-by-batch-size", "4"],
    # up to 12 proposals: with lengths that adapt (engine/speculative.py), long copies get
    # long proposals while refusals shrink them to one or two
    "ngram-k12": ["--speculative", "ngram", "--num-speculative-tokens", "12", "--speculative-ngram-min", "2",
                  "--speculative-ngram-max", "4"],
    "draft-int4": ["--speculative", "draft", "--num-speculative-tokens", "4", "--speculative-draft-quantize",
                   "int4"],  # the model's own checkpoint, int4, as its draft
}

CODE = '''def compute_average(values):
    """Return the mean of a list of numbers."""
    total = 0
    for value in values:
        total += value
    return total / len(vaules)
'''
RECORD = ("Our new customer is Maria Lopez. She lives at 42 Harbour Street, Lisbon, and can be reached at "
          "maria.lopez@example.com or on +351 912 345 678. Her account number is AC-99812 and she joined on "
          "March 3, 2026.")
PARAGRAPH = ("The lighthouse stood at the edge of the cliff for two hundred years. Every night its keeper climbed "
             "the one hundred and twelve steps, lit the great lamp, and watched the ships pass safely through the "
             "narrow channel below.")
COPY_HEAVY = [
    f"Fix the typo in this Python function and return the whole corrected function:\n```python\n{CODE}```",
    f"Rename the variable `total` to `running_sum` in this function and return the whole function:\n"
    f"```python\n{CODE}```",
    f"Extract the name, address, email, phone number and account number from this text as a JSON object:\n{RECORD}",
    f"Repeat the following paragraph exactly, word for word:\n{PARAGRAPH}",
    f"Add a docstring line saying it raises ZeroDivisionError for an empty list, and return the whole function:\n"
    f"```python\n{CODE}```",
    f"Rewrite this text with every sentence on its own line:\n{PARAGRAPH}",
    f"Copy this record and then list its fields one per line:\n{RECORD}",
    f"Return this code unchanged but with type hints added:\n```python\n{CODE}```",
]
FREE_CHAT = [
    "Write a short story about a lighthouse keeper.", "Explain why the sky is blue.",
    "Give me three ideas for a rainy afternoon.", "What makes a good cup of tea?",
    "Describe a city at night.", "Why do cats purr?", "Write a poem about the sea.",
    "How do plants grow?",
]


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def generate(stub, ids: list[int], max_tokens: int) -> tuple[float, float, int]:
    """(seconds, TTFT seconds, output tokens) of one greedy stream."""
    request = pb.GenerateRequest(request_id="b", input_ids=ids, sampling=pb.SamplingParameters(),
                                 stopping=pb.StoppingCriteria(max_new_tokens=max_tokens))
    started = time.perf_counter()
    first = None
    tokens = 0
    for _ in stub.Generate(request, timeout=600):
        tokens += 1
        first = first or time.perf_counter()
    return time.perf_counter() - started, first - started, tokens


def clients(stub, prompts: list[list[int]], n: int, max_tokens: int) -> dict:
    """``n`` clients, each sending its share of ``prompts`` one after another."""
    runs: list[tuple[float, float, int]] = []
    lock = threading.Lock()

    def one(mine):
        for ids in mine:
            r = generate(stub, ids, max_tokens)
            with lock:
                runs.append(r)

    threads = [threading.Thread(target=one, args=(prompts[i::n],)) for i in range(n)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    tokens = sum(r[2] for r in runs)
    decode = [(r[0] - r[1]) / (r[2] - 1) for r in runs if r[2] > 1]
    return {"clients": n, "requests": len(runs), "output_tokens": tokens, "wall_s": wall,
            "output_tok_s": tokens / wall, "tpot_p50_ms": percentile(decode, 50) * 1000}


def spec_metrics(port: int) -> dict:
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith("vllm:spec_decode_num_") and "_per_pos" not in line:
            name = line.split("{")[0].removeprefix("vllm:spec_decode_num_").removesuffix("_total")
            out[name] = float(line.rsplit(" ", 1)[1])
    return out


def start_config(name: str, model, prompts: dict[str, list[list[int]]]):
    flags = list(CONFIGS[name])
    if name.startswith("draft"):
        flags += ["--speculative-draft-model", str(model)]
    # no prefix caching: each round computes every prompt in full, as the first did (with
    # it, a server's later rounds would find their prompts cached and time only decoding)
    shard = start_shard(model, "--kv-cache-memory", "1GiB", "--max-total-tokens", "2048", "--no-prefix-caching",
                        *flags, metrics=True, timeout=900)
    # warm-up: first touches of the pool and kernels, and of every verification shape a
    # workload brings (a round's first copy-heavy run was a third slower without it)
    for ids in prompts.values():
        generate(shard.stub(), ids[0], 32)
    return shard, " ".join(flags)


def run_workload(shard, ids: list[list[int]], max_tokens: int) -> dict:
    """One workload on one server: 1 client, then 8; the acceptance from its metrics."""
    stub = shard.stub()
    before = spec_metrics(shard.metrics_port)
    result = {"1": clients(stub, ids, 1, max_tokens), "8": clients(stub, ids, 8, max_tokens)}
    after = spec_metrics(shard.metrics_port)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    if delta.get("drafts"):
        result["acceptance"] = {"proposed": delta["draft_tokens"], "accepted": delta["accepted_tokens"],
                                "rate": delta["accepted_tokens"] / max(delta["draft_tokens"], 1),
                                "mean_acceptance_length": 1 + delta["accepted_tokens"] / delta["drafts"]}
    return result


def run_rounds(names: list[str], model, prompts: dict[str, list[list[int]]], max_tokens: int,
               rounds: int, done) -> dict[str, list[dict]]:
    """Every configuration's server up at once; each workload ``rounds`` times on each, the
    order reversed every round. ``done(runs)`` after each round."""
    shards = {}
    try:
        for name in names:
            shards[name] = start_config(name, model, prompts)
        runs = {name: [] for name in names}
        for r in range(rounds):
            order = names if r % 2 == 0 else names[::-1]
            for name in names:
                runs[name].append({"flags": shards[name][1]})
            for kind, ids in prompts.items():
                for name in order:
                    runs[name][r][kind] = run_workload(shards[name][0], ids, max_tokens)
            done(runs)
        return runs
    finally:
        for shard, _ in shards.values():
            shard.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--configs", default="none,ngram,ngram-min1,ngram-pause4,draft-int4")
    parser.add_argument("--rounds", type=int, default=1,
                        help="every configuration's server up at once, each workload run this many times on each, "
                             "interleaved: speeds are medians, speed-ups the median of each round's ratio; results "
                             "in speculative-rounds*.md")
    parser.add_argument("--render", action="store_true",
                        help="only rewrite this kind of machine's results (speculative.md, or the "
                             "-amd-avx512 or -avx2 file: common.isa_results) from its .json")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    results_name = isa_results("speculative" if args.rounds == 1 else "speculative-rounds")
    if args.render:
        rerender(results_name, render)
        return
    from transformers import AutoTokenizer

    model = local_checkpoint(default_model_file())
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = {"copy-heavy": [chat_ids(tokenizer, t) for t in COPY_HEAVY],
               "free chat": [chat_ids(tokenizer, t) for t in FREE_CHAT]}
    load_before = os.getloadavg()[0]
    command = f"python -m bench.speculative_bench --max-tokens {args.max_tokens} --configs {args.configs}" + (
        f" --rounds {args.rounds}" if args.rounds > 1 else "")
    results = {"machine": machine(), "max_tokens": args.max_tokens, "configs": {}, "rounds": args.rounds,
               "interleaved": "workload",
               "command": command}

    def done(runs: dict[str, list[dict]]) -> None:
        for name, mine in runs.items():
            results["configs"][name] = mine[0] if args.rounds == 1 else median_config(mine)
        write_results(results_name, results, render(results))

    run_rounds(args.configs.split(","), model, prompts, args.max_tokens, args.rounds, done)
    results["load_average_1m"] = {"before": load_before, "after": os.getloadavg()[0]}
    write_results(results_name, results, render(results))


def median_config(runs: list[dict]) -> dict:
    """A configuration's rounds as one: each speed the median over the rounds, the
    acceptance of the last (greedy: the same tokens every round), and the rounds."""
    out = {"flags": runs[0]["flags"], "rounds": runs}
    for kind in runs[0]:
        if kind == "flags":
            continue
        out[kind] = {n: {k: statistics.median(run[kind][n][k] for run in runs) for k in runs[0][kind][n]}
                     for n in ("1", "8")}
        if "acceptance" in runs[-1][kind]:
            out[kind]["acceptance"] = runs[-1][kind]["acceptance"]
    return out


def speed_up(c: dict, base: dict, kind: str, clients: str) -> str:
    """Output tokens/s over the configuration without speculation: with rounds, the median
    of each round's ratio (a drift of the machine between rounds falls on both sides)."""
    if kind not in base:
        return "—"
    pairs = zip(c.get("rounds", []), base.get("rounds", []))
    ratios = [a[kind][clients]["output_tok_s"] / b[kind][clients]["output_tok_s"] for a, b in pairs]
    one_run = c[kind][clients]["output_tok_s"] / base[kind][clients]["output_tok_s"]
    ratio = statistics.median(ratios) if ratios else one_run
    spread = f" ({min(ratios):.2f}–{max(ratios):.2f})" if len(ratios) > 1 else ""
    return f"{ratio:.2f}×{spread}"


INTERLEAVED = {  # how a rounds file's configurations took turns (older files: one server run each)
    "server run": "the configurations interleaved (each once a round)",
    "workload": "every configuration's server up at once, each workload run on each in turn, the order reversed "
                "every round (none, ngram, then ngram, none)",
}


def render(r: dict) -> str:
    m = r["machine"]
    configs = r["configs"]
    base = configs.get("none", {})
    lines = [
        "# Speculative decoding on the default model", "",
        f"`{r['command']}` — {m['date']}, {m['cpu']}, {m['cores']} cores, torch {m['torch']}.", "",
        "SmolLM2-135M-Instruct in float32, one `kubeshard serve-shard` per configuration over gRPC"
        + (" (prefix caching off: every run computes its prompts in full)" if r.get("interleaved") == "workload"
           else "") + ", greedy, at "
        f"most {r['max_tokens']} output tokens (answers end at EOS or the limit; every configuration generates "
        "the same tokens). *copy-heavy*: fixing, renaming, extracting and quoting from the prompt; *free chat*: "
        "questions whose answers copy nothing. Speed-up: output tokens/s over the same workload without "
        "speculation, in this run." + (
            f" {r['rounds']} rounds, {INTERLEAVED[r.get('interleaved', 'server run')]}: speeds are the median of "
            "the rounds; a speed-up is the median of each round's ratio, its lowest and highest in brackets."
            if r.get("rounds", 1) > 1 else ""), "",
        "| configuration | workload | tok/s @1 | speed-up @1 | decode ms/token p50 @1 | tok/s @8 | speed-up @8 "
        "| proposals kept | tokens per verification |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, c in configs.items():
        for kind in ("copy-heavy", "free chat"):
            if kind not in c:
                continue
            one, eight = c[kind]["1"], c[kind]["8"]
            up1, up8 = speed_up(c, base, kind, "1"), speed_up(c, base, kind, "8")
            acc = c[kind].get("acceptance")
            kept = f"{acc['rate']:.0%}" if acc else "—"
            length = f"{acc['mean_acceptance_length']:.2f}" if acc else "—"
            lines.append(f"| {name} | {kind} | {one['output_tok_s']:.1f} | {up1} | {one['tpot_p50_ms']:.1f} | "
                         f"{eight['output_tok_s']:.1f} | {up8} | {kept} | {length} |")
    lines += ["", "Flags per configuration: " + "; ".join(f"{k}: `{v['flags'] or '(none)'}`"
                                                         for k, v in configs.items()) + ".", ""]
    if "load_average_1m" in r:
        lines.append(f"1-minute load average: {r['load_average_1m']['before']:.1f} before, "
                     f"{r['load_average_1m']['after']:.1f} after (2 cores).")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
