"""The default model (SmolLM2-135M-Instruct, served as ``smollm2-135m-instruct``) through
``kubeshard serve`` over HTTP: streaming ``/v1/chat/completions``, greedy, at most 128
output tokens (a real model: each answer ends at its EOS or at the limit).

- 1 client: requests one after another; TTFT and time per output token (p50), and the
  output tokens/s one stream gets;
- 16 clients: each sends its requests one after another, all 16 at once; TTFT and time
  per output token p50/p99, output tokens/s over all of them;
- peak RSS (VmHWM) of the model server and of the router, read before they stop.

No response cache (``--no-redis``), distinct questions; the chat template's shared system
prompt is what the prefix cache may reuse, as for any chat client. Each side gets one
unmeasured warm-up on other questions first (the KV pool's first touch, oneDNN's first
build of each batch shape).

    python -m bench.default_model_bench [--max-tokens 128] [--rounds 2] [--single 8] [--render]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import httpx
import psutil

from bench.common import kubeshard, machine, peak_rss_bytes, percentile, rerender, write_results
from tests.support.ports import free_port
from tests.support.processes import start
from tests.support.servers import ROUTER_READY
from tests.support.sse import DONE, sse_data

MODEL = "smollm2-135m-instruct"
TOPICS = ["the ocean", "a lighthouse keeper", "the first snow of winter", "a city at night", "an old library",
          "a robot learning to paint", "the desert at dawn", "a mountain village", "a lost letter", "the moon",
          "a train journey", "a garden in spring", "a friendly dragon", "the last day of summer", "a clockmaker",
          "a ship in a storm", "a forest after rain", "a street musician", "an island far away", "a kite",
          "a bakery at sunrise", "two old friends", "a river", "the northern lights", "a violin", "a quiet harbour",
          "a school trip", "a map with no name", "a cat on a roof", "a festival of lanterns", "the wind",
          "a mountain hut", "a painter's last painting", "a field of sunflowers", "an abandoned station",
          "a message in a bottle", "the city's oldest tree", "a night market", "a long walk home", "a bridge"]


def question(topic: str) -> str:
    return f"Write a short story about {topic}."


async def chat_stream(client: httpx.AsyncClient, text: str, max_tokens: int) -> tuple[float, float, int]:
    """(TTFT s, time per output token s, output tokens) of one streamed chat answer."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "temperature": 0,
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            event = sse_data(line)
            if event is None or event == DONE:
                continue
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if any(c["delta"].get("content") for c in event.get("choices", [])):
                now = time.perf_counter()
                first = first or now
                last = now
    tpot = (last - first) / (tokens - 1) if tokens > 1 else float("nan")
    return first - started, tpot, tokens


async def clients(url: str, n: int, questions: list[str], max_tokens: int) -> dict:
    """``n`` clients, each asking its share of ``questions`` one after another."""
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=64)) as client:
        async def one_client(mine: list[str]) -> list[tuple[float, float, int]]:
            return [await chat_stream(client, q, max_tokens) for q in mine]

        started = time.perf_counter()
        per_client = await asyncio.gather(*(one_client(questions[i::n]) for i in range(n)))
        wall = time.perf_counter() - started
    runs = [r for c in per_client for r in c]
    ttft, tpot, tokens = [r[0] for r in runs], [r[1] for r in runs], [r[2] for r in runs]
    return {"clients": n, "requests": len(runs), "wall_s": wall, "output_tokens": sum(tokens),
            "mean_output_tokens": sum(tokens) / len(runs), "output_tok_s": sum(tokens) / wall,
            "ttft_p50_ms": percentile(ttft, 50) * 1000, "ttft_p99_ms": percentile(ttft, 99) * 1000,
            "tpot_p50_ms": percentile(tpot, 50) * 1000, "tpot_p99_ms": percentile(tpot, 99) * 1000}


def peak_rss_of_children(pid: int) -> dict[str, int]:
    found: dict[str, int] = {}
    for child in psutil.Process(pid).children(recursive=True):
        try:
            cmd = " ".join(child.cmdline())
        except psutil.Error:
            continue
        role = "router" if "kubeshard_router" in cmd or "kubeshard-router" in cmd else (
            "model_server" if "serve-shard" in cmd else None)
        if role:
            found[role] = max(found.get(role, 0), peak_rss_bytes(child.pid))
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="requests per client at 16 clients")
    parser.add_argument("--single", type=int, default=8, help="requests at 1 client")
    parser.add_argument("--render", action="store_true", help="only rewrite default-model.md from its .json")
    args = parser.parse_args()
    if args.render:
        rerender("default-model", render)
        return
    load_before = os.getloadavg()[0]
    port = free_port()
    command = ["serve", "--port", str(port), "--no-redis", "--kv-cache-memory", "1GiB"]
    started = time.perf_counter()
    serve = start("kubeshard serve", kubeshard(*command), ROUTER_READY, timeout=900)
    ready_s = time.perf_counter() - started
    url = f"http://127.0.0.1:{port}"
    measured = [question(t) for t in TOPICS[:max(args.single, 16 * args.rounds)]]
    warm = [f"Describe {t} in two sentences." for t in TOPICS[:16]]
    try:
        asyncio.run(clients(url, 1, warm[:1], args.max_tokens))
        one = asyncio.run(clients(url, 1, measured[:args.single], args.max_tokens))
        asyncio.run(clients(url, 16, warm, args.max_tokens))
        sixteen = asyncio.run(clients(url, 16, measured[:16 * args.rounds], args.max_tokens))
        rss = peak_rss_of_children(serve.proc.pid)
    finally:
        serve.stop()
    results = {"machine": machine(), "command": "python -m bench.default_model_bench " +
               f"--max-tokens {args.max_tokens} --rounds {args.rounds} --single {args.single}",
               "serve": "kubeshard " + " ".join(command), "ready_s": ready_s,
               "workload": {"model": MODEL, "dtype": "float32", "max_tokens": args.max_tokens, "temperature": 0,
                            "api": "/v1/chat/completions, stream"},
               "one_client": one, "sixteen_clients": sixteen, "peak_rss_bytes": rss,
               "load_average_1m": {"before": load_before, "after": os.getloadavg()[0]}}
    write_results("default-model", results, render(results))


def render(r: dict) -> str:
    o, s, m = r["one_client"], r["sixteen_clients"], r["machine"]
    rss = r["peak_rss_bytes"]
    return f"""# The default model over HTTP

`{r['command']}` — {m['date']}, {m['cpu']}, {m['cores']} cores, torch {m['torch']}.
It starts `{r['serve'].replace('--port ' + r['serve'].split('--port ')[1].split()[0], '--port PORT')}` (ready after
{r['ready_s']:.0f} s, the GGUF conversion already cached) and streams `/v1/chat/completions`:
SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to float32: hidden 576, 30 layers, 9/3 heads,
vocab 49,152), greedy, "Write a short story about …" questions, at most {r['workload']['max_tokens']} output tokens
(answers end at the model's EOS or at the limit: {o['mean_output_tokens']:.0f} and {s['mean_output_tokens']:.0f} tokens on average below).
No response cache; one unmeasured warm-up on other questions before each side.

| | 1 client ({o['requests']} requests in a row) | 16 clients ({s['requests']} requests, {s['requests'] // 16} each) |
|---|---:|---:|
| TTFT p50 | {o['ttft_p50_ms']:.0f} ms | {s['ttft_p50_ms']:.0f} ms |
| TTFT p99 | {o['ttft_p99_ms']:.0f} ms | {s['ttft_p99_ms']:.0f} ms |
| time per output token p50 | {o['tpot_p50_ms']:.1f} ms | {s['tpot_p50_ms']:.1f} ms |
| time per output token p99 | {o['tpot_p99_ms']:.1f} ms | {s['tpot_p99_ms']:.1f} ms |
| output tokens/s (all clients) | {o['output_tok_s']:.1f} | {s['output_tok_s']:.1f} |

Peak RSS: model server {rss.get('model_server', 0) / 2**20:.0f} MiB (its float32 weights are 540 MB; its KV pool was
given 1 GiB), router {rss.get('router', 0) / 2**20:.0f} MiB.

For scale, `engine.md` measures the `small` demo model (~32M parameters, 8 layers) the
same way; SmolLM2 is about 4× the parameters and 30 layers deep.
This machine is shared and its speed drifts between runs (see the README), so compare
figures within one run; the 1-minute load average was {r['load_average_1m']['before']:.1f} before this run and
{r['load_average_1m']['after']:.1f} after it (2 cores: above 2, other work shared the cores).
"""


if __name__ == "__main__":
    main()
