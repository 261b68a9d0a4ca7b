"""Sharding benchmark (issue: sharded model groups) on the `small` demo model.

For N = 1, 2, 4 and each strategy: output tokens/s with 64 concurrent requests,
decode ms/token at batch 1, peak RSS per rank, and the share of the leader's step time
spent in group communication (``kubeshard_group_comm_seconds`` over the step-time sum,
both from the leader's /metrics).

    python -m bench.sharding_bench [--device cpu|cuda] [--dtype float32|bfloat16] [--shards 1,2,4]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import urllib.request

from bench.common import demo_model, grpc_workload, kubeshard, machine, peak_rss_bytes, \
    write_results
from tests.support.ports import free_port
from tests.support.processes import start
from tests.support.shard_process import READY as SHARD_READY

REQUESTS, PROMPT, NEW = 64, 128, 64


def info(address: str):
    import grpc

    from kubeshard_proto import pb, pb_grpc

    with grpc.insecure_channel(address) as channel:
        return pb_grpc.TextGenerationStub(channel).Info(pb.InfoRequest(), timeout=30)


def scrape(port: int, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", body, re.M)
    return float(m.group(1)) if m else 0.0


def run_config(model_dir, strategy: str, shards: int, device: str, dtype: str, prompts, warm) -> dict:
    master, port, metrics = free_port(), free_port(), free_port()
    threads = max(1, 2 // shards) if device == "cpu" else 1
    common = ["--model", str(model_dir), "--host", "127.0.0.1", "--device", device, "--dtype", dtype,
              "--strategy", strategy, "--shards", str(shards), "--master-addr", "127.0.0.1",
              "--master-port", str(master), "--kv-cache-memory", "512MiB", "--num-threads", str(threads)]
    procs = [start(f"rank {r}", kubeshard("serve-shard", *common, "--rank", str(r), "--port", "0",
                                          "--metrics-port", "0"), SHARD_READY, wait=False)
             for r in range(1, shards)]
    try:
        leader = start("rank 0", kubeshard("serve-shard", *common, "--rank", "0", "--port", str(port),
                                           "--metrics-port", str(metrics)), SHARD_READY, timeout=900)
        procs.insert(0, leader)
        result = asyncio.run(grpc_workload(f"127.0.0.1:{port}", prompts, NEW, warm_prompts=warm))
        step = scrape(metrics, "kubeshard_engine_step_seconds_sum")
        comm = scrape(metrics, "kubeshard_group_comm_seconds_total")
        result["comm_share"] = comm / step if step else 0.0
        result["parameter_mib"] = [b / 2**20 for b in info(f"127.0.0.1:{port}").rank_parameter_bytes]
        result["peak_rss_mib"] = [peak_rss_bytes(p.proc.pid) / 2**20 for p in procs]
    finally:
        for p in procs:
            p.stop()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--shards", default="1,2,4")
    parser.add_argument("--name", default=None, help="results file name (default sharding or sharding-cuda)")
    args = parser.parse_args()
    model_dir = demo_model("llama", "small")
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 8192) for _ in range(PROMPT)] for _ in range(REQUESTS)]
    warm = [[rng.randrange(5, 8192) for _ in range(PROMPT)] for _ in range(REQUESTS)]
    rows = []
    for shards in [int(s) for s in args.shards.split(",")]:
        for strategy in (["tensor"] if shards == 1 else ["tensor", "zero3"]):
            print(f"running N={shards} {strategy} ...", flush=True)
            r = run_config(model_dir, strategy, shards, args.device, args.dtype, prompts, warm)
            rows.append({"shards": shards, "strategy": strategy if shards > 1 else "none", **r})
    name = args.name or ("sharding" if args.device == "cpu" else "sharding-cuda")
    write_results(name, {"machine": machine(), "device": args.device, "dtype": args.dtype, "rows": rows},
                  render(rows, args))


def render(rows, args) -> str:
    lines = [
        "# Sharding benchmark", "",
        f"`python -m bench.sharding_bench --device {args.device} --dtype {args.dtype}` on the `small` demo model: "
        f"{REQUESTS} concurrent requests of {PROMPT}-token prompts, {NEW} new tokens, greedy, after a warm-up "
        "on other prompts. Ranks share the machine's cores (`--num-threads` = cores / shards).", "",
        "| shards | strategy | output tok/s (64 concurrent) | batch-1 decode ms/token | comm share of step time "
        "| parameters per rank (MiB) | peak RSS per rank (MiB) |",
        "|---:|---|---:|---:|---:|---|---|",
    ]
    for r in rows:
        rss = ", ".join(f"{x:.0f}" for x in r["peak_rss_mib"])
        params = ", ".join(f"{x:.0f}" for x in r.get("parameter_mib", []))
        lines.append(f"| {r['shards']} | {r['strategy']} | {r['tok_s']:.0f} | {r['tpot_1_ms']:.1f} | "
                     f"{100 * r['comm_share']:.0f}% | {params} | {rss} |")
    if args.device == "cpu":
        lines += ["", EXPLANATION]
    return "\n".join(lines) + "\n"


EXPLANATION = """What it shows. On one 2-core machine sharding cannot pay: every rank competes for the same two
cores and the same memory bus, so a group of N does the same arithmetic as one process plus the
communication. Tensor parallelism adds two all-reduces per layer (attention output and MLP down
projection) and a logits gather per step; over gloo on loopback each costs a round of memcpy and
socket wake-ups that are comparable to a whole decode step of this small model, so the
communication share grows with N. ZeRO-3 all-gathers every layer's weights every step (prefetched
while the previous layer computes, but on two busy cores the overlap is small) — it trades
communication for memory, and each rank runs its own batch, so its per-step batches are smaller.
What the group does deliver is the memory split: resident parameters per rank are 1/N of the
model (the column above), which is what lets a model larger than one device's memory serve at
all. The peak RSS is dominated by the Python and torch runtime (about 0.4 GiB) and each rank's
512 MiB KV pool, not by weights, for a model this small. On a GPU node with NVLink the same
collectives run on NCCL at hundreds of GB/s and the balance flips; `python -m bench.cuda_check`
runs this benchmark there (bfloat16)."""


if __name__ == "__main__":
    main()
