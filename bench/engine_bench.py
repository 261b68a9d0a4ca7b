"""Engine benchmark (issue: model server engine), on the `small` demo model, float32, CPU.

Offline, in one run, side by side: 64 requests of 128-token prompts, 128 new tokens
each, greedy, EOS ignored —
  (a) transformers `generate`, one request at a time (a bounded subset; per-request
      throughput does not depend on how many run one after another),
  (b) transformers `generate` with all 64 in one batch,
  (c) kubeshard with all 64 sent concurrently over gRPC.
Online, through `kubeshard serve` over HTTP with SSE streaming: at 1 client, time to
first token and time per output token; at 64 clients, output tokens/s and TTFT p50/p99.
Also batch-1 decode time per token against the memory-bandwidth bound, and peak RSS.
Every side gets one unmeasured warm-up run before it is measured.

    python -m bench.engine_bench [--sequential 16]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import httpx
import torch

from bench.common import demo_model, grpc_workload, kubeshard, machine, peak_rss_bytes, \
    percentile, rerender, self_peak_rss, write_results
from tests.support.ports import free_port
from tests.support.processes import start
from tests.support.servers import ROUTER_READY
from tests.support.shard_process import READY as SHARD_READY
from tests.support.sse import sse_data

N_REQUESTS, PROMPT, NEW = 64, 128, 128
VLLM = {"offline_tok_s": 816, "seq_tok_s": 48, "batched_tok_s": 259, "ttft_1_ms": 67, "tpot_1_ms": 17.4,
        "online_64_tok_s": 711, "ttft_64_p50_s": 2.4, "ttft_64_p99_s": 3.3}


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(PROMPT)] for _ in range(N_REQUESTS)]


def hf_sequential(model, ids: list[list[int]], count: int) -> float:
    tokens, started = 0, time.perf_counter()
    for p in ids[:count]:
        x = torch.tensor([p])
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, min_new_tokens=NEW,
                             do_sample=False, pad_token_id=0)
        tokens += out.shape[1] - len(p)
    return tokens / (time.perf_counter() - started)


def hf_batched(model, ids: list[list[int]]) -> float:
    x = torch.tensor(ids)
    model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16, min_new_tokens=16,
                   do_sample=False, pad_token_id=0)  # warm-up, as the engine gets one
    started = time.perf_counter()
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, min_new_tokens=NEW,
                         do_sample=False, pad_token_id=0)
    return (out.shape[0] * (out.shape[1] - x.shape[1])) / (time.perf_counter() - started)


def gemm_peak() -> float:
    """Float32 FLOP/s of the model's largest projections at prefill size, through the same
    GEMM path the engine uses (the machine's practical ceiling for this workload)."""
    from kubeshard_shard.models.layers import linear

    x, w = torch.randn(2048, 512), torch.randn(2816, 512)
    for _ in range(3):
        linear(x, w)
    best = float("inf")
    for _ in range(10):
        t = time.perf_counter()
        linear(x, w)
        best = min(best, time.perf_counter() - t)
    return 2 * 2048 * 512 * 2816 / best


def copy_bandwidth() -> float:
    """Bytes per second of a large tensor copy (the bound a batch-1 decode cannot beat:
    it must stream every weight once per token)."""
    src = torch.ones(256 * 1024 * 1024 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(10):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return src.numel() * 4 / best


async def http_stream(client: httpx.AsyncClient, url: str, text: str) -> tuple[float, float, int]:
    """(TTFT, time per output token, tokens) of one streamed request."""
    body = {"inputs": text, "parameters": {"max_new_tokens": NEW, "decoder_input_details": False}}
    started = time.perf_counter()
    first = last = None
    n = 0
    async with client.stream("POST", url + "/generate_stream", json=body,
                             headers={"Cache-Control": "no-cache"}) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            event = sse_data(line)
            if event is not None and event.get("token"):
                now = time.perf_counter()
                first = first or now
                last = now
                n += 1
    tpot = (last - first) / (n - 1) if n > 1 else float("nan")
    return first - started, tpot, n


async def online(url: str, texts: list[str], warm_texts: list[str]) -> dict:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=128)) as client:
        await asyncio.gather(*(http_stream(client, url, t) for t in warm_texts))  # warm-up, other prompts
        single = [await http_stream(client, url, t) for t in texts[1:9]]
        started = time.perf_counter()
        many = await asyncio.gather(*(http_stream(client, url, t) for t in texts))
        wall = time.perf_counter() - started
    return {
        "ttft_1_ms": percentile([s[0] for s in single], 50) * 1000,
        "tpot_1_ms": percentile([s[1] for s in single], 50) * 1000,
        "online_64_tok_s": sum(m[2] for m in many) / wall,
        "ttft_64_p50_s": percentile([m[0] for m in many], 50),
        "ttft_64_p99_s": percentile([m[0] for m in many], 99),
    }


def ignore_eos_texts(model_dir, ids) -> list[str]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return [tok.decode(p) for p in ids]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sequential", type=int, default=16, help="requests for baseline (a)")
    parser.add_argument("--render", action="store_true", help="only rewrite engine.md from engine.json")
    args = parser.parse_args()
    if args.render:
        rerender("engine", lambda data: render(data, data.get("sequential", args.sequential)))
        return
    from transformers import AutoModelForCausalLM

    model_dir = demo_model("llama", "small")
    ids = prompts(8192)
    results: dict = {"machine": machine(), "sequential": args.sequential, "workload": {"requests": N_REQUESTS, "prompt_tokens": PROMPT,
                                                        "new_tokens": NEW, "dtype": "float32"}}

    # (c) kubeshard over gRPC, first, on a quiet machine
    port = free_port()
    server = start("serve-shard", kubeshard("serve-shard", "--model", str(model_dir), "--host", "127.0.0.1",
                                            "--port", str(port), "--metrics-port", "0", "--kv-cache-memory", "1GiB"),
                   SHARD_READY, timeout=600)
    try:
        grpc_res = asyncio.run(grpc_workload(f"127.0.0.1:{port}", ids, NEW, warm_prompts=prompts(8192, seed=1)))
        grpc_res["peak_rss_bytes"] = peak_rss_bytes(server.proc.pid)
    finally:
        server.stop()
    results["kubeshard_grpc"] = grpc_res

    # online through `kubeshard serve` (router + engine), no response cache
    http_port = free_port()
    serve = start("serve", kubeshard("serve", "--model", str(model_dir), "--port", str(http_port), "--no-redis",
                                     "--kv-cache-memory", "1GiB"), ROUTER_READY, timeout=600)
    try:
        results["online"] = asyncio.run(online(f"http://127.0.0.1:{http_port}", ignore_eos_texts(model_dir, ids),
                                               ignore_eos_texts(model_dir, prompts(8192, seed=2))))
    finally:
        serve.stop()

    # transformers baselines, in this process
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hf_sequential(hf, ids, 1)  # warm-up
        results["hf_sequential_tok_s"] = hf_sequential(hf, ids, args.sequential)
        results["hf_batched_tok_s"] = hf_batched(hf, ids)
    results["hf_peak_rss_bytes"] = self_peak_rss()

    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    bw = copy_bandwidth()
    results["gemm_peak_gflops"] = gemm_peak() / 1e9
    bound_ms = weight_bytes / bw * 1000
    results["decode_bound"] = {"weight_bytes": weight_bytes, "copy_bandwidth_gb_s": bw / 1e9,
                               "bound_ms_per_token": bound_ms,
                               "measured_ms_per_token": grpc_res["tpot_1_ms"],
                               "ratio": grpc_res["tpot_1_ms"] / bound_ms}
    results["vllm_reference"] = VLLM
    write_results("engine", results, render(results, args.sequential))


def render(r: dict, sequential: int) -> str:
    a, b, c = r["hf_sequential_tok_s"], r["hf_batched_tok_s"], r["kubeshard_grpc"]["tok_s"]
    import transformers

    ref_a, ref_b = VLLM["seq_tok_s"], VLLM["batched_tok_s"]
    fa, fb = a / ref_a, b / ref_b
    gflops = 0.84e12 * c / (N_REQUESTS * NEW) / 1e9
    m = r["machine"]
    hf_version, torch_version = transformers.__version__, m["torch"]
    o, d = r["online"], r["decode_bound"]
    # the vLLM-CPU figures this run beats (higher is better for throughput, lower for times)
    ours = {"offline_tok_s": c, **{k: o[k] for k in ("ttft_1_ms", "tpot_1_ms", "online_64_tok_s", "ttft_64_p50_s",
                                                      "ttft_64_p99_s")}}
    labels = {"offline_tok_s": "offline throughput", "ttft_1_ms": "TTFT at one client",
              "tpot_1_ms": "time per token at one client", "online_64_tok_s": "throughput at 64 clients",
              "ttft_64_p50_s": "TTFT p50 at 64", "ttft_64_p99_s": "TTFT p99 at 64"}
    behind = [labels[k] for k, v in ours.items() if (v < VLLM[k] if k.endswith("tok_s") else v > VLLM[k])]
    verdict = ("kubeshard is ahead on every one" if not behind
               else f"kubeshard is behind on {', '.join(behind)} and ahead on the others")
    return f"""# Engine benchmark

`python -m bench.engine_bench` — {m['date']}, {m['cpu']}, {m['cores']} cores, torch {m['torch']}.
Workload: the `small` llama demo model (hidden 512, 8 layers, 8/4 heads, vocab 8192, ~32M
parameters), float32; 64 requests of 128-token prompts, 128 new tokens each, greedy, EOS ignored.
Each side is measured after one unmeasured warm-up run (transformers: one request, and one
short batch of 64; kubeshard: the workload once on *other* prompts — it touches the KV pool
pages and lets oneDNN build its GEMM kernels for each batch shape, while the measured prompts
never hit the prefix cache).

## Offline throughput (output tokens/s, same run)

| | tokens/s | kubeshard ÷ this | vLLM-CPU 0.32 on this shape (issue) |
|---|---:|---:|---:|
| (a) transformers `generate`, one at a time ({sequential} requests) | {a:.1f} | **{c / a:.1f}×** (target ≥ 16×) | 48 (17×) |
| (b) transformers `generate`, 64 batched | {b:.1f} | **{c / b:.2f}×** (target ≥ 3×) | 259 (3.2×) |
| (c) kubeshard, 64 concurrent over gRPC | {c:.1f} | 1 | 816 |

## Online, through `kubeshard serve` (router + engine, HTTP/SSE streaming, no cache)

| | kubeshard | vLLM server (issue) |
|---|---:|---:|
| 1 client: TTFT p50 | {o['ttft_1_ms']:.0f} ms | 67 ms |
| 1 client: time per output token p50 | {o['tpot_1_ms']:.1f} ms | 17.4 ms |
| 64 clients: output tokens/s | {o['online_64_tok_s']:.0f} | 711 |
| 64 clients: TTFT p50 | {o['ttft_64_p50_s']:.2f} s | 2.4 s |
| 64 clients: TTFT p99 | {o['ttft_64_p99_s']:.2f} s | 3.3 s |

## Batch-1 decode against the memory-bandwidth bound

Weights {d['weight_bytes'] / 1e6:.0f} MB; measured copy bandwidth {d['copy_bandwidth_gb_s']:.1f} GB/s;
bound {d['bound_ms_per_token']:.2f} ms/token; measured {d['measured_ms_per_token']:.2f} ms/token over gRPC
→ **{d['ratio']:.2f}×** the bound (target ≤ 3×).

## Reading these numbers

The ratio targets (≥ 16× (a), ≥ 3× (b)) were set from the issue's reference machine, where
transformers did {ref_a} and {ref_b} tokens/s; on this machine and with these library versions
(transformers {hf_version}, torch {torch_version}) the same baselines run {fa:.1f}× and {fb:.1f}× faster
({a:.0f} and {b:.0f} tokens/s), so the ratios compare against a much stronger baseline. The whole
workload is about 0.84 TFLOP (prefill without the LM head, decode with it): kubeshard's
{c:.0f} tokens/s sustain {gflops:.0f} GFLOP/s on two cores, and 3× the batched baseline
({3 * b:.0f} tokens/s) would take {3 * b * 0.84e12 / (N_REQUESTS * NEW) / 1e9:.0f} GFLOP/s sustained — against a peak of
{r.get("gemm_peak_gflops", float("nan")):.0f} GFLOP/s for the model's largest projection alone at prefill size. The decode half of
the work cannot run near that peak: its GEMMs have 64 rows, and its attention is bound by
memory, since every step reads all 64 contexts' K and V (about 200 MB in float32).
Against the absolute figures the issue names for
vLLM-CPU 0.32 on this shape (816 tokens/s offline; 711 tokens/s, TTFT 2.4 s / 3.3 s at 64
clients; 67 ms TTFT and 17.4 ms per token at one client), {verdict}.
Those are the issue's figures from another machine; vLLM-CPU measured beside kubeshard in one
run, by one harness, is `peers_bench` (`hack/engines.sh vllm` builds it; `peers*.md`).

## Memory

Peak RSS: kubeshard model server {r['kubeshard_grpc']['peak_rss_bytes'] / 2**20:.0f} MiB (a 1 GiB KV pool,
which the warm-up run touched); transformers baseline process {r['hf_peak_rss_bytes'] / 2**20:.0f} MiB.
"""


if __name__ == "__main__":
    main()
