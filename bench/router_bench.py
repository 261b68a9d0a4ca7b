"""Router benchmark: overhead, capacity, cache-hit throughput, prefix affinity.

    python -m bench.router_bench [overhead|capacity|cache|affinity|all]

- overhead: latency added by the router (HTTP/SSE in, gRPC out) against calling the
  StubBackend test double directly over gRPC, at 1 and 200 concurrent streams;
- capacity: 2,000 concurrent streaming clients on one router replica (stub backend);
- cache: cache-hit throughput of one router process pinned to one core (real Redis);
- affinity: 8 shared system prompts x many suffixes over 4 replicas of the real engine,
  prefix affinity against round-robin (engine prefix-cache hit rate, mean TTFT).

Every process binds 127.0.0.1; results go to bench/results/router.json and router.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import resource
import sys
import time
from typing import Any, Callable

import grpc
import orjson
import psutil

from bench.common import CACHE, RESULTS, cpu_model, md_table, percentile
from bench.router_load import DirectGRPC, RawHTTP, Sample, summary_ms
from kubeshard_proto import pb, pb_grpc
from tests.support.processes import Proc, start
from tests.support.servers import start_router, start_shard
from tests.support.stub_backend import stub_tokenizer_json

STUB_READY = __import__("re").compile(r"stub backend on (?P<host>[^:\s]+):(?P<port>\d+)")
PROMPT = "hello world, this is the router benchmark prompt"


def raise_fd_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def start_stub(*flags: str) -> Proc:
    return start("stub", [sys.executable, "-m", "tests.support.stub_backend", *flags], STUB_READY, timeout=60)


def cpu_seconds(proc: Proc) -> float:
    t = psutil.Process(proc.proc.pid).cpu_times()
    return t.user + t.system


async def closed_loop(make_worker: Callable[[], Any], concurrency: int, per_worker: int) -> list[Sample]:
    samples: list[Sample] = []

    async def worker() -> None:
        run, close = await make_worker()
        try:
            for _ in range(per_worker):
                samples.append(await run())
        finally:
            await close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples


async def _overhead_at(router: Proc, stub: Proc, concurrency: int, per_worker: int, tokens: int) -> dict:
    from tokenizers import Tokenizer
    ids = Tokenizer.from_str(stub_tokenizer_json()).encode(PROMPT).ids
    body = orjson.dumps({"inputs": PROMPT, "parameters": {"max_new_tokens": tokens}})
    host, port = router.match["host"], int(router.match["port"])
    direct = DirectGRPC(stub.address)

    async def direct_worker():
        return (lambda: direct.generate(ids, tokens)), (lambda: asyncio.sleep(0))

    async def router_worker():
        c = RawHTTP(host, port)
        await c.connect()
        return (lambda: c.post("/generate_stream", body)), c.close

    await closed_loop(direct_worker, concurrency, max(5, per_worker // 10))  # warm-up
    await closed_loop(router_worker, concurrency, max(5, per_worker // 10))
    result = {}
    for name, make in (("direct", direct_worker), ("router", router_worker)):
        cpu0 = cpu_seconds(router)
        t0 = time.perf_counter()
        samples = await closed_loop(make, concurrency, per_worker)
        wall = time.perf_counter() - t0
        result[name] = {**summary_ms(samples), "requests_per_s": len(samples) / wall}
        if name == "router":
            result[name]["router_cpu_ms_per_request"] = (cpu_seconds(router) - cpu0) / len(samples) * 1e3
    await direct.close()
    d, r = result["direct"], result["router"]
    result["added"] = {k: r[k] - d[k] for k in ("ttft_p50_ms", "ttft_p99_ms", "total_p50_ms", "total_p99_ms")}
    return result


def bench_overhead(tokens: int = 16, paced_s: float = 0.02) -> dict:
    out: dict = {"tokens_per_stream": tokens, "paced_token_interval_s": paced_s}
    for label, delay, runs in (("immediate", 0.0, (("c1", 1, 2000), ("c200", 200, 20))),
                               ("paced", paced_s, (("c200", 200, 10),))):
        stub = start_stub("--token-delay", str(delay))
        router = start_router("--backend", f"stub={stub.address}", "--no-redis", "--log-level", "warning")
        try:
            for key, concurrency, per_worker in runs:
                out[f"{key}_{label}"] = asyncio.run(_overhead_at(router, stub, concurrency, per_worker, tokens))
        finally:
            router.stop()
            stub.stop()
    return out


async def _capacity(router: Proc, clients: int, tokens: int) -> dict:
    host, port = router.match["host"], int(router.match["port"])
    body = orjson.dumps({"inputs": PROMPT, "parameters": {"max_new_tokens": tokens}})
    rproc = psutil.Process(router.proc.pid)
    rss0 = rproc.memory_info().rss
    peak = {"rss": rss0, "fds": rproc.num_fds(), "connections": 0}
    done = asyncio.Event()

    async def sample() -> None:
        while not done.is_set():
            peak["rss"] = max(peak["rss"], rproc.memory_info().rss)
            peak["fds"] = max(peak["fds"], rproc.num_fds())
            await asyncio.sleep(0.2)

    samples: list[Sample] = []
    errors: list[str] = []

    async def client(i: int) -> None:
        await asyncio.sleep(i * 0.001)  # a 2 s ramp
        c = RawHTTP(host, port)
        try:
            await c.connect()
            s = await c.post("/generate_stream", body)
            samples.append(s)
            if not s.ok or s.events != tokens:
                errors.append(f"status {s.status}, {s.events} events")
        except Exception as exc:
            errors.append(repr(exc))
        finally:
            await c.close()

    sampler = asyncio.create_task(sample())
    t0 = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    wall = time.perf_counter() - t0
    done.set()
    await sampler
    return {"clients": clients, "tokens_per_stream": tokens, "completed": len(samples), "errors": len(errors),
            "error_examples": errors[:5], "wall_s": wall, "router_rss_start_mib": rss0 / 2**20,
            "router_rss_peak_mib": peak["rss"] / 2**20, "router_peak_fds": peak["fds"],
            "stream_total_p50_s": percentile([s.total for s in samples], 50),
            "stream_total_p99_s": percentile([s.total for s in samples], 99),
            "ttft_p99_s": percentile([s.ttft for s in samples], 99)}


def bench_capacity(clients: int = 2000, tokens: int = 10, delay: float = 0.5) -> dict:
    raise_fd_limit()
    stub = start_stub("--token-delay", str(delay))
    router = start_router("--backend", f"stub={stub.address}", "--no-redis", "--log-level", "warning",
                          "--max-queue-per-model", "4096")
    try:
        return {**asyncio.run(_capacity(router, clients, tokens)), "token_interval_s": delay}
    finally:
        router.stop()
        stub.stop()


async def _cache(router: Proc, seconds: float, concurrency: int) -> dict:
    host, port = router.match["host"], int(router.match["port"])
    body = orjson.dumps({"inputs": PROMPT, "parameters": {"max_new_tokens": 16, "details": True}})
    warm = RawHTTP(host, port)
    await warm.post("/generate", body)
    await asyncio.sleep(0.5)  # the entry is written in the background
    await warm.post("/generate", body)
    await warm.close()
    count = 0
    errors = 0
    stop = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal count, errors
        c = RawHTTP(host, port)
        await c.connect()
        while time.perf_counter() < stop:
            s = await c.post("/generate", body)
            count += 1
            errors += 0 if s.ok else 1
        await c.close()

    cpu0 = cpu_seconds(router)
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    return {"requests": count, "errors": errors, "requests_per_s": count / wall, "concurrency": concurrency,
            "router_cpu_utilization": (cpu_seconds(router) - cpu0) / wall}


def _metric(url: str, name: str) -> float:
    import httpx
    total = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


def bench_cache(seconds: float = 8.0, concurrency: int = 32) -> dict:
    from tests.support.redis_server import RedisServer
    redis = RedisServer()
    redis.start()
    stub = start_stub()
    router = start_router("--backend", f"stub={stub.address}", "--redis-url", redis.url, "--log-level", "warning")
    cores = sorted(os.sched_getaffinity(0))
    try:
        os.sched_setaffinity(router.proc.pid, {cores[0]})  # the router gets one core...
        others = set(cores[1:]) or {cores[0]}
        os.sched_setaffinity(0, others)                      # ...the client, Redis and stub the rest
        os.sched_setaffinity(redis.proc.pid, others)
        os.sched_setaffinity(stub.proc.pid, others)
        hits0 = _metric(router.url, "kubeshard_router_cache_hits_total")
        out = asyncio.run(_cache(router, seconds, concurrency))
        out["cache_hits_counted"] = _metric(router.url, "kubeshard_router_cache_hits_total") - hits0 - 1
        return out
    finally:
        os.sched_setaffinity(0, set(cores))
        router.stop()
        stub.stop()
        redis.close()


def _system_prompts(tokenizer, n: int, target_tokens: int) -> list[str]:
    rng = random.Random(7)
    words = ["policy", "answer", "customer", "careful", "context", "detail", "always", "never", "user",
             "document", "summary", "format", "language", "polite", "brief", "explain", "example", "rule"]
    prompts = []
    for i in range(n):
        text = f"System {i}: you are assistant number {i} of the kubeshard benchmark."
        while len(tokenizer.encode(text).ids) < target_tokens:
            text += " " + rng.choice(words)
        prompts.append(text)
    return prompts


async def _affinity_run(router: Proc, requests: list[str], concurrency: int, tokens: int) -> list[Sample]:
    host, port = router.match["host"], int(router.match["port"])
    queue = list(requests)
    samples: list[Sample] = []

    async def worker() -> None:
        c = RawHTTP(host, port)
        await c.connect()
        while queue:
            prompt = queue.pop()
            samples.append(await c.post("/generate_stream", orjson.dumps(
                {"inputs": prompt, "parameters": {"max_new_tokens": tokens}}), {"Cache-Control": "no-store, no-cache"}))
        await c.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples


def _stats(shards: list[Proc]) -> list[pb.StatsResponse]:
    out = []
    for s in shards:
        with grpc.insecure_channel(s.address) as ch:
            out.append(pb_grpc.TextGenerationStub(ch).Stats(pb.StatsRequest(), timeout=10))
    return out


def bench_affinity(replicas: int = 4, systems: int = 8, suffixes: int = 40, kv: str = "1MiB",
                   concurrency: int = 8, tokens: int = 8) -> dict:
    from tokenizers import Tokenizer

    from kubeshard_shard.demo_model import cached_demo_model
    model = cached_demo_model(CACHE / "demo-models", arch="llama", size="tiny", seed=0)
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    prompts = _system_prompts(tokenizer, systems, 256)
    rng = random.Random(11)
    requests = [f"{p}\nQuestion {j} from user {rng.randrange(10**6)}: what is {rng.random():.6f}?"
                for p in prompts for j in range(suffixes)]
    rng.shuffle(requests)
    out: dict = {"replicas": replicas, "system_prompts": systems, "suffixes_per_prompt": suffixes,
                 "system_prompt_tokens": 256, "kv_cache_per_replica": kv, "concurrency": concurrency,
                 "max_new_tokens": tokens, "model": model.name}
    for mode in ("prefix", "round-robin"):
        shards = [start_shard(model, "--max-input-tokens", "400", "--max-total-tokens", "512",
                              "--kv-cache-memory", kv) for _ in range(replicas)]
        router = start_router("--backend", "tiny=" + ",".join(s.address for s in shards), "--no-redis",
                              "--balance", mode, "--log-level", "warning")
        try:
            before = _stats(shards)
            samples = asyncio.run(_affinity_run(router, requests, concurrency, tokens))
            after = _stats(shards)
            hits = sum(a.prefix_cache_hits - b.prefix_cache_hits for a, b in zip(after, before))
            queries = sum(a.prefix_cache_queries - b.prefix_cache_queries for a, b in zip(after, before))
            per_replica = [a.prefix_cache_queries - b.prefix_cache_queries for a, b in zip(after, before)]
            out[mode] = {"prefix_cache_hit_rate": hits / max(1, queries), "block_hits": hits,
                         "block_queries": queries, "requests_per_replica_blocks": per_replica,
                         "errors": sum(1 for s in samples if not s.ok),
                         "mean_ttft_ms": sum(s.ttft for s in samples) / len(samples) * 1e3,
                         "p50_ttft_ms": percentile([s.ttft for s in samples], 50) * 1e3,
                         "p99_ttft_ms": percentile([s.ttft for s in samples], 99) * 1e3}
        finally:
            router.stop()
            for s in shards:
                s.stop()
    rr = out["round-robin"]["prefix_cache_hit_rate"]
    out["hit_rate_ratio"] = out["prefix"]["prefix_cache_hit_rate"] / rr if rr else float("inf")
    return out


def environment() -> dict:
    return {"python": sys.version.split()[0], "cpus": os.cpu_count(), "machine": platform.machine(),
            "cpu_model": cpu_model(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "load_average_at_start": os.getloadavg()}


def render(results: dict) -> str:
    lines = ["# Router benchmark", "",
             f"Machine: {results['environment']['cpus']} CPUs ({results['environment']['cpu_model']}), "
             f"Python {results['environment']['python']}; run {results['environment']['date']}; load average "
             f"{results['environment'].get('load_average_at_start', ['?'])[0]} at start (the machine is shared "
             "with other work, so latencies carry noise). "
             "All traffic on 127.0.0.1. Reproduce: `python -m bench.router_bench all`.", ""]
    o = results.get("overhead")
    if o:
        lines += ["## Router overhead (StubBackend test double)", "",
                  f"Each request streams {o['tokens_per_stream']} tokens. *Direct*: a gRPC client on the "
                  "stub. *Router*: HTTP `POST /generate_stream` (SSE) through `kubeshard-router` to the "
                  "same stub. Added = router - direct, per percentile. *immediate*: the stub streams "
                  f"tokens as fast as it can; *paced*: one token every {o['paced_token_interval_s'] * 1e3:.0f} ms "
                  "(an engine's decode step), so 200 streams do not saturate the machine.", "",
                  "| run | path | TTFT p50 | TTFT p99 | stream p50 | stream p99 | req/s | router CPU/req |",
                  "|---|---|---|---|---|---|---|---|"]
        for run in ("c1_immediate", "c200_immediate", "c200_paced"):
            if run not in o:
                continue
            for path in ("direct", "router"):
                r = o[run][path]
                cpu = f"{r['router_cpu_ms_per_request']:.2f} ms" if "router_cpu_ms_per_request" in r else ""
                lines.append(f"| {run} | {path} | {r['ttft_p50_ms']:.2f} ms | {r['ttft_p99_ms']:.2f} ms | "
                             f"{r['total_p50_ms']:.2f} ms | {r['total_p99_ms']:.2f} ms | {r['requests_per_s']:.0f} | {cpu} |")
            a = o[run]["added"]
            lines.append(f"| {run} | **added** | **{a['ttft_p50_ms']:.2f} ms** | **{a['ttft_p99_ms']:.2f} ms** | "
                         f"**{a['total_p50_ms']:.2f} ms** | **{a['total_p99_ms']:.2f} ms** | | |")
        lines += ["", "Targets: p50 <= 1 ms and p99 <= 5 ms added. At 200 concurrent streams this 2-CPU "
                  "machine is saturated by the load generator, the stub and the router together (the "
                  "direct path alone already queues for tens to hundreds of ms), so the added figures "
                  "there are CPU queueing, not the router's latency; the router's CPU per request is the "
                  "figure that carries over to a larger machine. Of the ~2 ms of router CPU per 16-token "
                  "stream, ~0.4 ms is the router itself (next table) and the rest is the grpcio client "
                  "reading 16 messages (its per-message cost is high in this sandbox).", ""]
    i = results.get("inprocess")
    if i:
        lines += ["### The router's own share", "",
                  "The same app with a stand-in replica client that hands over ready Token messages "
                  "(no gRPC): what the router's HTTP/SSE, validation, tokenization, balancing and "
                  "bookkeeping cost by themselves, per request, at concurrency 1.", ""]
        lines += md_table(["route", "TTFT p50", "latency p50", "latency p99", "router CPU/req"],
                          [[f"`{route}` ({i['tokens_per_stream']} tokens)", f"{r['ttft_p50_ms']:.2f} ms",
                            f"{r['p50_ms']:.2f} ms", f"{r['p99_ms']:.2f} ms", f"{r['router_cpu_ms_per_request']:.2f} ms"]
                           for route, r in ((route, i[route]) for route in ("/generate_stream", "/generate"))])
        lines.append("")
    c = results.get("capacity")
    if c:
        lines += ["## Capacity: concurrent streaming clients on one router replica", "",
                  f"{c['clients']} clients each open one SSE stream of {c['tokens_per_stream']} tokens "
                  f"(one token every {c['token_interval_s']} s from the stub), ramped over ~2 s, all held at once.", "",
                  "| clients | completed | errors | router RSS start | router RSS peak | peak fds | stream p50 | stream p99 |",
                  "|---|---|---|---|---|---|---|---|",
                  f"| {c['clients']} | {c['completed']} | {c['errors']} | {c['router_rss_start_mib']:.0f} MiB | "
                  f"{c['router_rss_peak_mib']:.0f} MiB | {c['router_peak_fds']} | {c['stream_total_p50_s']:.2f} s | "
                  f"{c['stream_total_p99_s']:.2f} s |", ""]
    k = results.get("cache")
    if k:
        lines += ["## Cache-hit throughput (one router process pinned to one core, real Redis)", "",
                  f"Non-streaming `/generate` of one greedy 16-token request, served from Redis; "
                  f"{k['concurrency']} keep-alive clients on the other core.", "",
                  "| requests | errors | served from cache | requests/s | router core utilization | "
                  "requests/s per fully used core |", "|---|---|---|---|---|---|",
                  f"| {k['requests']} | {k['errors']} | {k['cache_hits_counted'] / max(1, k['requests']) * 100:.0f}% | "
                  f"**{k['requests_per_s']:.0f}** | {k['router_cpu_utilization'] * 100:.0f}% | "
                  f"{k['requests_per_s'] / max(0.01, k['router_cpu_utilization']):.0f} |", "",
                  *(["Requests not served from the cache are Redis lookups that ran past `--redis-timeout` "
                     "(50 ms) on the loaded machine: they fell back to the backend, as designed.", ""]
                    if k["cache_hits_counted"] < k["requests"] else [])]
    a = results.get("affinity")
    if a:
        lines += ["## Prefix affinity vs round-robin (real engine, 4 replicas)", "",
                  f"{a['system_prompts']} shared system prompts of {a['system_prompt_tokens']} tokens x "
                  f"{a['suffixes_per_prompt']} suffixes each, shuffled, {a['concurrency']} concurrent streams, "
                  f"{a['max_new_tokens']} new tokens; model {a['model']} on CPU; KV cache "
                  f"{a['kv_cache_per_replica']} per replica (the cache is under pressure, as in production). "
                  "Hit rate from each engine's Stats (prefix-cache block hits / lookups) over the run.", ""]
        lines += md_table(["balancing", "prefix-cache hit rate", "mean TTFT", "p99 TTFT", "errors"],
                          [[mode, f"{m['prefix_cache_hit_rate'] * 100:.1f}%", f"{m['mean_ttft_ms']:.1f} ms",
                            f"{m['p99_ttft_ms']:.1f} ms", str(m["errors"])]
                           for mode, m in ((mode, a[mode]) for mode in ("prefix", "round-robin"))])
        lines += ["", f"Hit rate ratio (affinity / round-robin): **{a['hit_rate_ratio']:.2f}x** (target >= 2x).", ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    if sys.argv[1:] == ["render"]:  # rewrite router.md from router.json
        (RESULTS / "router.md").write_text(render(json.loads((RESULTS / "router.json").read_text())))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("which", nargs="*", default=["all"],
                        choices=["overhead", "inprocess", "capacity", "cache", "affinity", "all"])
    args = parser.parse_args()
    which = ({"overhead", "inprocess", "capacity", "cache", "affinity"} if "all" in args.which
             else set(args.which))
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "router.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results["environment"] = environment()
    from bench.router_inprocess import bench_inprocess
    for name, fn in (("overhead", bench_overhead), ("inprocess", bench_inprocess), ("capacity", bench_capacity),
                     ("cache", bench_cache), ("affinity", bench_affinity)):
        if name in which:
            print(f"running {name} ...", flush=True)
            results[name] = fn()
            print(json.dumps(results[name], indent=2), flush=True)
            path.write_text(json.dumps(results, indent=2) + "\n")
    (RESULTS / "router.md").write_text(render(results))


if __name__ == "__main__":
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    main()
