"""What a step's token choice costs on the CPU: each row's argmax and log-sum-exp from
the kernel (``csrc/logits.cpp``, what the sampler and the speculative verification
call) against torch's argmax and log_softmax (what they called before), on random
logits of the default model's vocabulary (49,152), for a decode at 1 sequence, a
verification of 6 proposals (7 rows) and a decode batch of 64. Median over the runs, the
two paths interleaved, torch's threads as a server sets them.

    python -m bench.sampler_bench [--vocab 49152] [--rows 1,7,64] [--reps 300]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import isa_results, machine, md_table, rerender, write_results
from kubeshard_shard.compute import configure_threads
from kubeshard_shard.engine import kernels


def per_call_us(fn, reps: int) -> float:
    started = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - started) / reps * 1e6


def measure(module, vocab: int, rows: int, reps: int, runs: int = 7) -> dict:
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows)) * 4
    paths = {"kernel": lambda: module.argmax_logsumexp(logits),
             "torch": lambda: (logits.argmax(dim=-1), torch.log_softmax(logits, dim=-1))}
    times = {name: [] for name in paths}
    for fn in paths.values():
        per_call_us(fn, 20)  # warm-up
    for _ in range(runs):
        for name, fn in paths.items():
            times[name].append(per_call_us(fn, reps))
    med = {name: statistics.median(t) for name, t in times.items()}
    return {"rows": rows, "kernel_us": med["kernel"], "torch_us": med["torch"], "speedup": med["torch"] / med["kernel"]}


def render(r: dict) -> str:
    m = r["machine"]
    lines = ["# A step's argmax and log-probabilities (CPU)", "",
             f"`{r['command']}` — {m['date']}, {m['cpu']}, {m['cores']} cores, torch {m['torch']}, "
             f"{r['threads']} torch threads.", "",
             f"Random logits of {r['vocab']:,} columns (the default model's vocabulary). *kernel*: each row's "
             "argmax and log-sum-exp in one call (`csrc/logits.cpp`, what the sampler and the speculative "
             "verification call); *torch*: `argmax` and `log_softmax` over the rows (what they called before). "
             "Median of 7 runs of the repetitions, the two paths interleaved.", ""]
    lines += md_table(["rows", "kernel µs", "torch µs", "kernel vs torch"],
                      [(x["rows"], f"{x['kernel_us']:.1f}", f"{x['torch_us']:.1f}", f"{x['speedup']:.2f}×")
                       for x in r["results"]], right=True)
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--rows", default="1,7,64")
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--render", action="store_true", help="rewrite the Markdown from the JSON, run nothing")
    args = parser.parse_args()
    name = isa_results("sampler")
    if args.render:
        rerender(name, render)
        return
    module = kernels.module()
    if module is None:
        raise SystemExit("the CPU kernels could not be built on this machine")
    configure_threads(None)  # as a server does
    threads = torch.get_num_threads()
    results = [measure(module, args.vocab, int(rows), args.reps) for rows in args.rows.split(",")]
    command = "python -m bench.sampler_bench" + (f" --vocab {args.vocab}" if args.vocab != 49152 else "") + \
        (f" --rows {args.rows}" if args.rows != "1,7,64" else "")
    data = {"machine": machine(), "command": command, "threads": threads, "vocab": args.vocab, "results": results}
    write_results(name, data, render(data))


if __name__ == "__main__":
    main()
