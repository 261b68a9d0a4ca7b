"""Activation cache benchmark (issue 13): time to first token with a shared prefix.

For 1,000- and 4,000-token shared prefixes, on the `small` demo model and on the default
real model (SmolLM2-135M-Instruct), side by side in one run, each a real `kubeshard
serve-shard` process over gRPC and a real redis-server:

- computed: a server with the cache off (no Redis), a prefix it never saw;
- populating: a server with the cache on, a prefix nobody saw (it looks the prefix up,
  misses, computes it, then writes its blocks after the first token);
- local: the prefix already in that server's own prefix cache;
- Redis: a fresh server (an empty local cache, as after a restart, a scale-up or a wake
  from zero) whose Redis holds the prefix, written by the other server;
- the same computed, local and Redis cases with `--concurrency` requests at once
  sharing one prefix.

Fairness: before each length every server (the fresh one included) runs an unrelated
prompt of that full length, so long-context kernels and allocations are warm for all;
computed and populating requests alternate (on, off, off, on, ...) on new prefixes,
each measured only after the other server's writes are in Redis, so the write overhead
is a paired comparison on the same machine state. Every phase records what the engine
did (Redis lookups, hit blocks, prefill tokens saved, timeouts, local prefix-cache hits,
fetch time); a local or Redis phase that did not hit, or a Redis fetch that timed out,
fails the run (the results are written first, with the problems listed).

Every prompt is the prefix and a unique 16-token tail. Single-request figures are
medians over `--reps` prefixes.

    python -m bench.activation_cache_bench [--models small,default] [--lengths 1000,4000] [--reps 3]
        [--concurrency 16] [--name activation-cache]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from pathlib import Path

from bench.common import demo_model, machine, md_table, percentile, write_results
from kubeshard_proto import pb
from tests.support.redis_server import RedisServer
from tests.support.shard_process import ShardProcess, start_shard

TAIL, NEW, BLOCK = 16, 4, 16
START_S = 1200  # a first start may compile the decode kernel
FIELDS = ("lookups", "hits", "hit_blocks", "miss_blocks", "prefill_tokens_saved", "timeouts", "redis_errors",
          "rejected_entries", "blocks_written", "fetch_seconds_sum", "fetch_count")


def request(ids: list[int]) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id="bench", input_ids=ids, sampling=pb.SamplingParameters(),
                              stopping=pb.StoppingCriteria(max_new_tokens=NEW, ignore_eos=True))


def ttft(stub, ids: list[int]) -> float:
    started, first = time.perf_counter(), None
    for _ in stub.Generate(request(ids), timeout=900):
        if first is None:
            first = time.perf_counter() - started
    return first


def ttfts_at_once(server: ShardProcess, prompts: list[list[int]]) -> list[float]:
    stubs = [server.stub() for _ in prompts]
    out: list[float] = [0.0] * len(prompts)
    gate = threading.Barrier(len(prompts))

    def run(i: int) -> None:
        gate.wait()
        out[i] = ttft(stubs[i], prompts[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def snapshot(server: ShardProcess) -> dict:
    """The counters a phase is judged by: the activation cache's and the local prefix cache's."""
    s = server.stats()
    out = {"prefix_cache_hits": s.prefix_cache_hits}
    if s.HasField("activation_cache"):
        out.update({f: getattr(s.activation_cache, f) for f in FIELDS})
    return out


def delta(server: ShardProcess, before: dict) -> dict:
    after = snapshot(server)
    return {k: after[k] - before.get(k, 0) for k in after}


def written(server: ShardProcess, before: dict, new_blocks: int, timeout: float = 300) -> float:
    """Waits until the blocks a phase added are in Redis (and nothing else is being
    written), so that no write runs under the next measurement; returns how long the
    wanted blocks took."""
    started = time.perf_counter()
    deadline = time.monotonic() + timeout
    want = before["blocks_written"] + new_blocks
    while server.stats().activation_cache.blocks_written < want:
        if time.monotonic() > deadline:
            raise RuntimeError(f"fewer than {new_blocks} new blocks were written in {timeout}s")
        time.sleep(0.02)
    took = time.perf_counter() - started
    last, still = -1, 0
    while still < 2 and time.monotonic() < deadline:  # then quiet for two polls
        now = server.stats().activation_cache.blocks_written
        still, last = (still + 1 if now == last else 0), now
        time.sleep(0.2)
    return took


def total(deltas: list[dict]) -> dict:
    return {k: sum(d[k] for d in deltas) for k in deltas[0]} if deltas else {}


def run_model(label: str, model_dir: Path, vocab: int, lengths: list[int], reps: int, concurrency: int,
              redis_url: str, kv: str) -> dict:
    rng = random.Random(sum(map(ord, label)))

    def tokens(n: int) -> list[int]:
        return [rng.randrange(5, vocab) for _ in range(n)]

    # no byte budget: a run writes every prefix it measures before reading them back from a
    # fresh server (1.2 GB for SmolLM2 at 4,000 tokens), and the default 1 GiB budget would
    # drop the oldest, which the fresh server then misses and writes again, dropping the next
    flags = ["--kv-cache-memory", kv, "--max-total-tokens", str(max(lengths) + TAIL + NEW + 16),
             "--activation-cache-min-hits", "1", "--activation-cache-max-bytes", "0"]
    prefixes = {L: [tokens(L) for _ in range(reps)] for L in lengths}     # populated, then local and Redis hits
    computed_prefix = {L: [tokens(L) for _ in range(reps + 1)] for L in lengths}
    shared = {L: tokens(L) for L in lengths}                              # the one all concurrent requests share
    res: dict = {"model": label, "lengths": {}, "problems": []}

    def check(ok: bool, what: str, d: dict) -> None:
        if not ok:
            res["problems"].append(f"{label}: {what}: {d}")

    off = start_shard(model_dir, *flags, timeout=START_S)                 # the cache off: no Redis
    on = start_shard(model_dir, *flags, "--redis-url", redis_url, timeout=START_S)
    try:
        for L in lengths:
            r = res["lengths"].setdefault(L, {})
            blocks = L // BLOCK                                           # full blocks of the prefix alone
            whole, tail_blocks = (L + TAIL) // BLOCK, (L + TAIL) // BLOCK - L // BLOCK   # a prompt's new blocks
            before = snapshot(on)
            for server in (off, on):                                      # warm at this length, unshared
                ttft(server.stub(), tokens(L + TAIL))
            written(on, before, whole)
            r["computed"], r["populating"], r["local"], r["write_done_s"] = [], [], [], []
            populating, local = [], []
            for i in range(reps):
                for side in (("on", "off") if i % 2 == 0 else ("off", "on")):
                    if side == "off":
                        r["computed"].append(ttft(off.stub(), computed_prefix[L][i] + tokens(TAIL)))
                        continue
                    before = snapshot(on)
                    r["populating"].append(ttft(on.stub(), prefixes[L][i] + tokens(TAIL)))
                    r["write_done_s"].append(written(on, before, whole))
                    populating.append(delta(on, before))
                before = snapshot(on)
                r["local"].append(ttft(on.stub(), prefixes[L][i] + tokens(TAIL)))
                written(on, before, tail_blocks)
                local.append(delta(on, before))
                check(local[-1]["prefix_cache_hits"] >= blocks, f"{L} local: the prefix was not a local hit",
                      local[-1])
            r["populating_phase"], r["local_phase"] = total(populating), total(local)
            check(r["populating_phase"]["hit_blocks"] == 0, f"{L} populating: a new prefix was found in Redis",
                  r["populating_phase"])

            r["computed_16"] = ttfts_at_once(off, [computed_prefix[L][reps] + tokens(TAIL)
                                                   for _ in range(concurrency)])
            before = snapshot(on)
            ttft(on.stub(), shared[L] + tokens(TAIL))
            written(on, before, whole)
            before = snapshot(on)
            r["local_16"] = ttfts_at_once(on, [shared[L] + tokens(TAIL) for _ in range(concurrency)])
            written(on, before, concurrency * tail_blocks)
            r["local_16_phase"] = delta(on, before)
            check(r["local_16_phase"]["prefix_cache_hits"] >= concurrency * blocks,
                  f"{L} local x{concurrency}: not every request hit the local prefix cache", r["local_16_phase"])
        s = on.stats().activation_cache
        res["bytes_per_token"] = s.bytes_written / (s.blocks_written * BLOCK)
    finally:
        off.stop()
        on.stop()

    fresh = start_shard(model_dir, *flags, "--redis-url", redis_url, timeout=START_S)  # never saw the prefixes
    try:
        for L in lengths:
            r = res["lengths"][L]
            blocks = L // BLOCK
            whole, tail_blocks = (L + TAIL) // BLOCK, (L + TAIL) // BLOCK - L // BLOCK
            before = snapshot(fresh)
            ttft(fresh.stub(), tokens(L + TAIL))                          # warm at this length, as the others
            written(fresh, before, whole)
            r["redis"], phases = [], []
            for p in prefixes[L]:
                before = snapshot(fresh)
                r["redis"].append(ttft(fresh.stub(), p + tokens(TAIL)))
                written(fresh, before, tail_blocks)
                phases.append(delta(fresh, before))
                check(phases[-1]["hit_blocks"] == blocks and phases[-1]["timeouts"] == 0,
                      f"{L} Redis: the prefix did not come from Redis", phases[-1])
            r["redis_phase"] = total(phases)
            before = snapshot(fresh)
            r["redis_16"] = ttfts_at_once(fresh, [shared[L] + tokens(TAIL) for _ in range(concurrency)])
            written(fresh, before, concurrency * tail_blocks)
            r["redis_16_phase"] = delta(fresh, before)
            check(r["redis_16_phase"]["hit_blocks"] >= blocks and r["redis_16_phase"]["timeouts"] == 0,
                  f"{L} Redis x{concurrency}: the prefix did not come from Redis", r["redis_16_phase"])
        s = fresh.stats().activation_cache
        res["fresh_rejected"] = s.rejected_entries
        res["fresh_bytes_read"] = s.bytes_read
    finally:
        fresh.stop()
    return res


def _per_fetch_ms(phase: dict) -> float:
    return phase["fetch_seconds_sum"] / phase["fetch_count"] * 1e3 if phase.get("fetch_count") else float("nan")


def summarize(r: dict) -> dict:
    med = statistics.median
    out = {}
    for L, x in r["lengths"].items():
        c, loc, red, pop = med(x["computed"]), med(x["local"]), med(x["redis"]), med(x["populating"])
        fetch = _per_fetch_ms(x["redis_phase"])
        pairs = [p / c_ - 1 for p, c_ in zip(x["populating"], x["computed"])]
        out[L] = {"computed_ms": c * 1e3, "local_ms": loc * 1e3, "redis_ms": red * 1e3, "populating_ms": pop * 1e3,
                  "redis_speedup": c / red, "redis_over_local": red / loc,
                  "populating_overhead": med(pairs), "populating_overhead_pairs": pairs,
                  "miss_lookup_ms": _per_fetch_ms(x["populating_phase"]), "redis_fetch_ms": fetch,
                  "redis_rest_ms": red * 1e3 - loc * 1e3 - fetch,
                  "write_done_ms": med(x["write_done_s"]) * 1e3,
                  "tokens_saved": x["redis_phase"]["prefill_tokens_saved"] / len(x["redis"]),
                  "phases": {k: x[k] for k in ("populating_phase", "local_phase", "local_16_phase", "redis_phase",
                                               "redis_16_phase")}}
        for case in ("computed_16", "local_16", "redis_16"):
            out[L][f"{case}_p50_ms"] = percentile(x[case], 50) * 1e3
            out[L][f"{case}_max_ms"] = max(x[case]) * 1e3
        out[L]["redis_16_speedup"] = out[L]["computed_16_p50_ms"] / out[L]["redis_16_p50_ms"]
        out[L]["redis_16_over_local"] = out[L]["redis_16_p50_ms"] / out[L]["local_16_p50_ms"]
    return out


def render(data: dict) -> str:
    lines = ["# Activation cache: time to first token with a shared prefix", "",
             f"Machine: {data['machine']['cpu']}, {data['machine']['cores']} cores, torch {data['machine']['torch']}; "
             f"{data['machine']['date']}. Command: `{data['command']}`.", "",
             "Real `kubeshard serve-shard` processes over gRPC, float32 on CPU, and a real redis-server on "
             "loopback. Each prompt is the shared prefix plus a unique 16-token tail; 4 new tokens. "
             "*computed*: the cache off, a prefix never seen; *populating*: the cache on, a prefix never seen "
             "(alternating with computed, each after the other's writes are done); *local*: the prefix in the "
             "server's own prefix cache; *Redis*: a fresh server (empty local cache) whose Redis holds the "
             "prefix, written by another server. Every server first ran an unrelated prompt of each length. "
             f"Single requests: median of {data['reps']} prefixes; {data['concurrency']} at once: p50 and max "
             "of their TTFTs.", ""]
    for model in data["models"]:
        s = model["summary"]
        lines += [f"## {model['model']}", ""]
        lines += md_table(
            ["prefix", "computed", "local hit", "Redis hit (fresh server)", "Redis vs computed",
             "Redis / local", "target"],
            [[L, f"{x['computed_ms']:.0f} ms", f"{x['local_ms']:.0f} ms", f"{x['redis_ms']:.0f} ms",
              f"{x['redis_speedup']:.1f}× faster", f"{x['redis_over_local']:.2f}×",
              "≥ 5× and ≤ 1.5×" if int(L) == 1000 else "—"] for L, x in s.items()], right=True, left=(6,))
        lines += ["", f"{data['concurrency']} concurrent requests sharing the prefix (TTFT p50 / max):", ""]
        lines += md_table(
            ["prefix", "computed", "local hit", "Redis hit (fresh server)", "Redis vs computed", "Redis / local"],
            [[L, *(f"{x[f'{case}_16_p50_ms']:.0f} / {x[f'{case}_16_max_ms']:.0f} ms"
                   for case in ("computed", "local", "redis")),
              f"{x['redis_16_speedup']:.1f}× faster", f"{x['redis_16_over_local']:.2f}×"] for L, x in s.items()], right=True)
        lines += ["", "The request that populates the cache (paired with a computed one), and what a hit reads:", ""]
        lines += md_table(
            ["prefix", "populating TTFT", "computed TTFT", "overhead (median of pairs)", "lookup that missed",
             "write in Redis after the first token", "Redis fetch of the prefix", "Redis − local − fetch",
             "prefill tokens saved"],
            [[L, f"{x['populating_ms']:.0f} ms", f"{x['computed_ms']:.0f} ms",
              f"{x['populating_overhead'] * 100:+.1f}%", f"{x['miss_lookup_ms']:.1f} ms",
              f"{x['write_done_ms']:.0f} ms", f"{x['redis_fetch_ms']:.0f} ms", f"{x['redis_rest_ms']:.0f} ms",
              f"{x['tokens_saved']:.0f}"] for L, x in s.items()], right=True)
        lines += ["", "What each phase did (summed over its requests):", ""]
        lines += md_table(
            ["prefix", "phase", "lookups", "hit blocks", "prefill tokens saved", "timeouts", "Redis errors",
             "local prefix-cache block hits"],
            [[L, name.removesuffix("_phase"),
              *(p.get(k, 0) for k in ("lookups", "hit_blocks", "prefill_tokens_saved", "timeouts",
                                      "redis_errors", "prefix_cache_hits"))]
             for L, x in s.items() for name, p in x["phases"].items()], right=True, left=(1,))
        lines += ["", f"Redis bytes per cached token: {model['bytes_per_token']:.0f} (K and V of every layer, "
                  "float32, plus a 64-byte header per 16-token block). Entries refused on the fresh server: "
                  f"{model['fresh_rejected']}.", ""]
        if model["problems"]:
            lines += ["**Problems** (the run failed):", ""] + [f"- {p}" for p in model["problems"]] + [""]
    lines += [data["analysis"], ""]
    return "\n".join(lines)


ANALYSIS = """## Reading the figures

- A Redis hit replaces the prefill of the prefix by one pipelined read of its blocks
  (one round trip per rank: a chain's keys share one Cluster slot) that lands in the
  paged pool before the request is scheduled; only the tail is computed. Its TTFT is
  the local hit's plus that fetch; the column "Redis − local − fetch" is what is left
  (handoffs, and noise). The fetch moves bytes over loopback: about 16 KiB per token on
  `small` and 45 KiB on SmolLM2-135M (float32 K and V of every layer).
- The populating request pays one Redis round trip that finds nothing (the lookup
  column) before it is scheduled; counting, probing and writing its blocks happen after
  its first token, in background threads, off the engine step. Its overhead is the
  median over pairs of a populating and a computed request run back to back.
- On a shared machine whose speed drifts, compare within one run."""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="small,default")
    ap.add_argument("--lengths", default="1000,4000")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--name", default="activation-cache", help="results file name under bench/results")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    redis = RedisServer()
    redis.start()
    models = []
    try:
        for name in args.models.split(","):
            if name == "small":
                label, path, vocab, kv = "small demo model (8 layers, 4 KV heads of 64)", demo_model(), 8192, "2GiB"
            else:
                from kubeshard_shard.checkpoints import default_model_file, local_checkpoint

                label, path, vocab, kv = ("SmolLM2-135M-Instruct (the default model; 30 layers, 3 KV heads of 64)",
                                          local_checkpoint(default_model_file()), 49152, "4GiB")
            redis.flushall()
            r = run_model(label, path, vocab, lengths, args.reps, args.concurrency, redis.url, kv)
            r["summary"] = summarize(r)
            models.append(r)
            print(r["summary"], flush=True)
    finally:
        redis.close()
    data = {"machine": machine(), "reps": args.reps, "concurrency": args.concurrency, "models": models,
            "analysis": ANALYSIS, "command": "python -m bench.activation_cache_bench " + " ".join(
                f"--{k} {v}" for k, v in vars(args).items())}
    write_results(args.name, data, render(data))
    problems = [p for m in models for p in m["problems"]]
    if problems:
        print("activation cache bench: phases that did not do what they measure:\n  " + "\n  ".join(problems),
              file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
