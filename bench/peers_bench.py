"""kubeshard against vLLM's CPU build and llama.cpp's server, driven by one third-party
harness (guidellm), one server at a time on this machine, in one run.

Workload (the same for every server): synthetic prompts of 128 tokens, 128 output
tokens each, greedy with EOS ignored (guidellm sends ``ignore_eos`` and ``max_tokens``),
streamed ``/v1/completions``; first 64 requests from 64 concurrent clients, then 16
requests from 1 client. Model: the ``small`` demo model (llama, ~32M parameters) as a
Hugging Face folder for kubeshard and vLLM, and as GGUF files of the same weights (F32,
Q8_0, Q4_0) for llama.cpp. Reported per server: output tokens/s at 64, TTFT p50/p99 at
64, TTFT and time per output token (and inter-token latency) p50 at 1, and the peak RSS
of the server's processes (VmHWM, summed over its process tree).

Environments: ``hack/engines.sh vllm``, ``hack/engines.sh llamacpp`` and ``hack/engines.sh
guidellm`` (built once, cached under $KUBESHARD_CACHE/engines); a server whose
environment is missing is reported as not run, with the command that builds it.

This shared machine's speed drifts by a tenth or more between runs minutes apart, as much
as the gaps being measured; ``--rounds N`` runs the servers N times, interleaved (each once
a round), and reports each figure's median with the throughput's range
(``peers-rounds*.md``).

    python -m bench.peers_bench [--servers kubeshard,vllm,llamacpp-f32,kubeshard-int8,...] [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
import torch

from bench.common import (demo_model, isa_results, kubeshard, load_average_lines, machine, peak_rss_bytes, rerender,
                          write_results)
from kubeshard_shard.config import MemoryBudget
from kubeshard_shard.engine.attention import KVCache
from kubeshard_shard.models.config import load_model_config
from kubeshard_shard.paths import cache_root
from tests.support.engines import missing, start_peer, stop_engine
from tests.support.gguf_files import write_gguf
from tests.support.ports import free_port
from tests.support.processes import start
from tests.support.servers import ROUTER_READY

MODEL_ID = "small"
PROMPT_TOKENS, OUTPUT_TOKENS = 128, 128
CONCURRENT, CONCURRENT_REQUESTS, SINGLE_REQUESTS = 64, 64, 16
KV_BUDGET = "1GiB"  # every server's KV cache (vLLM: VLLM_CPU_KVCACHE_SPACE=1)
# each kubeshard server beside the peers it is compared with, so a drift of the machine's
# speed during the run (up to a third between hours here) falls on both sides alike
SERVERS = ("kubeshard", "vllm", "llamacpp-f32", "kubeshard-int8", "llamacpp-q8_0", "kubeshard-int4",
           "llamacpp-q4_0")
GUIDELLM = cache_root() / "engines" / "guidellm-0.8.1" / "bin" / "guidellm"


def scenario(url: str, tokenizer: Path, profile: dict, requests: int) -> dict:
    return {"spec": {
        # validate_backend off: llama-cpp-python's server has no /health route
        "backend": {"kind": "openai_http", "target": url, "model": MODEL_ID, "request_format": "/v1/completions",
                    "validate_backend": False},
        "profile": profile,
        "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer)},
        "data": [{"kind": "synthetic_text", "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS}],
        "constraints": [{"kind": "max_requests", "count": requests}],
    }}


def guidellm(url: str, tokenizer: Path, profile: dict, requests: int, workdir: Path) -> dict:
    """Runs one guidellm benchmark; its metrics of the successful requests."""
    spec, out = workdir / "scenario.json", workdir / "out.json"
    spec.write_text(json.dumps(scenario(url, tokenizer, profile, requests)))
    out.unlink(missing_ok=True)
    subprocess.run([str(GUIDELLM), "run", "-c", str(spec), "--output", f"kind=json,path={out}",
                    "--disable-progress", "--disable-console"], check=True, timeout=3600,
                   env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    b = json.loads(out.read_text())["benchmarks"][0]["metrics"]

    def stat(name: str, key: str) -> float:
        s = b[name]["successful"]
        return s["mean"] if key == "mean" else s["percentiles"][key]

    totals = b["request_totals"]
    return {"successful": totals.get("successful"), "errored": totals.get("errored"),
            "output_tok_s": stat("output_tokens_per_second", "mean"),
            "ttft_p50_ms": stat("time_to_first_token_ms", "p50"), "ttft_p99_ms": stat("time_to_first_token_ms", "p99"),
            "tpot_p50_ms": stat("time_per_output_token_ms", "p50"), "itl_p50_ms": stat("inter_token_latency_ms", "p50"),
            "output_tokens_p50": stat("output_token_count", "p50")}


def tree_peak_rss(pid: int) -> int:
    try:
        procs = [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return 0
    return sum(peak_rss_bytes(p.pid) for p in procs)


def start_server(name: str, model: Path, ggufs: dict[str, Path]):
    """(process, base URL, stop) of one server."""
    if name.startswith("kubeshard"):
        port = free_port()
        flags = ["serve", "--model", str(model), "--model-id", MODEL_ID, "--no-redis", "--port", str(port),
                 "--kv-cache-memory", KV_BUDGET, "--max-num-seqs", str(CONCURRENT), "--max-total-tokens", "512"]
        if name != "kubeshard":
            flags += ["--quantize", name.split("-", 1)[1]]
        proc = start(name, kubeshard(*flags), ROUTER_READY, timeout=900)
        return proc, f"http://127.0.0.1:{port}", proc.stop
    if name == "vllm":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        proc, url = start_peer("vllm", model, MODEL_ID, 512, extra_args=["--dtype", "float32"])
        return proc, url, lambda: stop_engine(proc)
    qtype = name.split("-", 1)[1].upper()
    proc, url = start_peer("llamacpp", ggufs[qtype], MODEL_ID, llamacpp_context(model))
    return proc, url, lambda: stop_engine(proc)


def llamacpp_context(model: Path) -> int:
    """llama.cpp's context in tokens for the same KV budget as the others: as many float16
    K/V tokens (its cache type) as fill it. Its server holds one context for every
    request, so 64 streams of 256 tokens need 16,384; the budget gives far more."""
    config = load_model_config(model)
    per_token = KVCache.bytes_per_block(config.num_hidden_layers, 1, config.num_key_value_heads, config.head_dim,
                                        torch.float16)
    return MemoryBudget.parse(KV_BUDGET).bytes // per_token


def not_built(name: str) -> str | None:
    engine = "vllm" if name == "vllm" else "llamacpp" if name.startswith("llamacpp") else None
    return missing(engine) if engine else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--servers", default=",".join(SERVERS))
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the servers this many times, interleaved (every server once a round), and "
                             "report each figure's median; results in peers-rounds*.md")
    parser.add_argument("--render", action="store_true")
    parser.add_argument("--check", action="store_true",
                        help="a quick run that checks every server works (few short requests; results not kept)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    results_name = isa_results("peers" if args.rounds == 1 else "peers-rounds")
    global CONCURRENT_REQUESTS, SINGLE_REQUESTS, OUTPUT_TOKENS
    if args.check:
        CONCURRENT_REQUESTS, SINGLE_REQUESTS, OUTPUT_TOKENS = 8, 2, 16
    if args.render:
        rerender(results_name, render)
        return
    if not GUIDELLM.is_file():
        raise SystemExit(f"guidellm is not built ({GUIDELLM}): run `hack/engines.sh guidellm`")
    model = demo_model(size="small")
    command = f"python -m bench.peers_bench --servers {args.servers}" + (
        f" --rounds {args.rounds}" if args.rounds > 1 else "")
    results = {"machine": machine(), "command": command, "rounds": args.rounds,
               "workload": {"prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS,
                            "concurrent": CONCURRENT, "concurrent_requests": CONCURRENT_REQUESTS,
                            "single_requests": SINGLE_REQUESTS, "harness": "guidellm 0.8.1", "kv_budget": KV_BUDGET,
                            "llamacpp_context": llamacpp_context(model)},
               "servers": {}, "load_average_1m": {"before": os.getloadavg()[0]}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ggufs = {}
        rounds: dict[str, list[dict]] = {}
        for name in [n for _ in range(args.rounds) for n in args.servers.split(",")]:
            why = not_built(name)
            if why:
                results["servers"][name] = {"not_run": why}
                continue
            if name.startswith("llamacpp"):
                qtype = name.split("-", 1)[1].upper()
                ggufs[qtype] = write_gguf(model, work / f"small-{qtype}.gguf", qtype)
            row = run_server(name, model, ggufs, work)
            rounds.setdefault(name, []).append(row)
            results["servers"][name] = row if args.rounds == 1 else median_row(rounds[name])
            print(name, json.dumps(row), flush=True)
            if not args.check:
                write_results(results_name, results, render(results))
    results["load_average_1m"]["after"] = os.getloadavg()[0]
    if not args.check:
        write_results(results_name, results, render(results))


def run_server(name: str, model: Path, ggufs: dict[str, Path], work: Path) -> dict:
    """One server's figures: it is started, warmed up, measured at 64 clients and at 1,
    and stopped; a failure is reported in the row, so the other servers still run."""
    started = time.perf_counter()
    try:
        proc, url, stop = start_server(name, model, ggufs)
    except Exception as exc:
        return {"not_run": f"failed to start: {exc!r}"[:2000]}
    row = {"start_s": time.perf_counter() - started}
    try:
        # warm-up: the first requests' one-time costs (pool first touch, kernel builds)
        guidellm(url, model, {"kind": "concurrent", "streams": 4}, 4, work)
        row["c64"] = guidellm(url, model, {"kind": "concurrent", "streams": CONCURRENT}, CONCURRENT_REQUESTS, work)
        row["c1"] = guidellm(url, model, {"kind": "synchronous"}, SINGLE_REQUESTS, work)
        row["peak_rss_bytes"] = tree_peak_rss(proc.proc.pid)
    except Exception as exc:
        row["error"] = repr(exc)[:2000]
    finally:
        stop()
    return row


def median_row(rows: list[dict]) -> dict:
    """One server's figures over its rounds: each figure's median over the rounds that ran
    (the largest peak RSS), and the rounds themselves."""
    done = [r for r in rows if "c64" in r and "c1" in r]
    if not done:
        return {**rows[-1], "rounds": rows}
    merged = {"rounds": rows, "peak_rss_bytes": max(r["peak_rss_bytes"] for r in done),
              "start_s": statistics.median(r["start_s"] for r in done)}
    for part in ("c64", "c1"):
        merged[part] = {k: statistics.median(r[part][k] for r in done) for k in done[0][part]
                        if isinstance(done[0][part][k], (int, float))}
    return merged


def render(r: dict) -> str:
    m, w = r["machine"], r["workload"]
    llamacpp = (f"llama.cpp: a context of {w['llamacpp_context']:,} float16 tokens, which fill it"
                if "llamacpp_context" in w else "llama.cpp: its context for 64 sequences of 512")
    ran_llamacpp = any(name.startswith("llamacpp") for name in r["servers"])
    n = r.get("rounds", 1)
    lines = [f"# kubeshard against vLLM-CPU{' and llama.cpp' if ran_llamacpp else ''} (one harness, "
             f"{'one run' if n == 1 else f'{n} rounds'})", "",
             f"`{r['command']}` — {m['date']}, {m['cpu']}, {m['cores']} cores, torch {m['torch']}.", "",
             f"Harness: {w['harness']}, streaming `/v1/completions`, synthetic prompts of {w['prompt_tokens']} tokens, "
             f"{w['output_tokens']} output tokens, greedy, EOS ignored; {w['concurrent_requests']} requests from "
             f"{w['concurrent']} concurrent clients, then {w['single_requests']} from 1 client. Model: the `small` demo "
             "model (float32 folder for kubeshard and vLLM" + ("; GGUF files of the same weights for llama.cpp"
                                                                if ran_llamacpp else "") + "). Servers "
             f"one at a time; KV budget {w['kv_budget']} each{f' ({llamacpp})' if ran_llamacpp else ''}. "
             "TPOT: guidellm's time per output token (request latency over output tokens); ITL: the time between "
             "streamed tokens." + (
                 f" {n} rounds, the servers interleaved (each once a round, in the order above): every figure is the "
                 "median of a server's rounds, with the lowest and highest throughput in brackets; peak RSS the "
                 "largest." if n > 1 else ""), "",
             "| server | out tok/s @64 | TTFT p50 / p99 @64 | TTFT p50 @1 | TPOT p50 @1 | ITL p50 @1 | peak RSS |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, row in r["servers"].items():
        if "not_run" in row or "c64" not in row:
            lines.append(f"| {name} | not run: {row.get('not_run') or row.get('error', '')[:200]} ||||||")
            continue
        a, b = row["c64"], row["c1"]
        spread = [x["c64"]["output_tok_s"] for x in row.get("rounds", []) if "c64" in x]
        spread = f" ({min(spread):.0f}–{max(spread):.0f})" if len(spread) > 1 else ""
        lines.append(f"| {name} | {a['output_tok_s']:.1f}{spread} | "
                     f"{a['ttft_p50_ms']:,.0f} / {a['ttft_p99_ms']:,.0f} ms | "
                     f"{b['ttft_p50_ms']:.1f} ms | {b['tpot_p50_ms']:.1f} ms | {b['itl_p50_ms']:.1f} ms | "
                     f"{row['peak_rss_bytes'] / 2**20:,.0f} MiB |")
    load = load_average_lines(r)
    if load:
        lines += ["", *load]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
