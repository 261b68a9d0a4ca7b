"""Structured output and multi-LoRA cost, measured side by side in one run.

(1) Constrained decoding: 16 requests decoding at once, all free text or all under a JSON
    schema (xgrammar masks in the batched sampler); time per output token over decode
    steps where all 16 are running. Target: constrained <= 1.10x free.
(2) Multi-LoRA: 16 requests on the base model of an engine without LoRA, against 16
    requests spread over 4 rank-16 adapters (all seven projections) in one batch; time per
    decode step with all 16 running. Target: <= 1.3x. The LoRA engine serving only base
    requests is shown too (the wrappers' own cost).

Each pair alternates over several rounds after a warm-up (the VM drifts between runs);
medians are reported. Models: the `small` demo model (~32M) and, when its conversion is
cached, the default SmolLM2-135M-Instruct.

    python -m bench.api_bench [--rounds 3] [--tokens 48]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import CACHE, RESULTS, machine
from kubeshard_shard.config import EngineConfig, MemoryBudget
from kubeshard_shard.engine.request import make_sampling_params
from kubeshard_shard.engine.sequence import GrammarSpec
from kubeshard_shard.server.factory import build_served_model

BATCH = 16
SCHEMA = {"type": "object", "properties": {
    "items": {"type": "array", "maxItems": 64, "items": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 48},
        "score": {"type": "integer", "minimum": 0, "maximum": 1000},
        "tags": {"type": "array", "maxItems": 8, "items": {"type": "string", "maxLength": 16}}},
        "required": ["name", "score", "tags"]}}},
    "required": ["items"]}


def engine(model_dir: Path, **kw):
    config = EngineConfig(model_dir=model_dir, model_id=model_dir.name, kv_cache_memory=MemoryBudget.parse("512MiB"),
                          max_total_tokens=1024, **kw)
    return build_served_model(config).engine


def prompts(vocab: int, n: int = BATCH, length: int = 32, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n, length), generator=g).tolist()


def decode_time(eng, requests) -> tuple[float, float, int]:
    """(seconds per output token, seconds per step) over steps with the whole batch decoding."""
    for i, (ids, params) in enumerate(requests):
        eng.add_request(str(i), ids, params)
    per_token, per_step, tokens = 0.0, [], 0
    while eng.has_work():
        full = len(eng.scheduler.running) == len(requests) and all(
            s.num_uncomputed_tokens == 1 for s in eng.scheduler.running)
        t0 = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t0
        if full and len(outs) == len(requests):
            per_step.append(dt)
            per_token += dt
            tokens += len(outs)
    return per_token / max(tokens, 1), statistics.median(per_step) if per_step else float("nan"), len(per_step)


def grammar_case(model_dir: Path, rounds: int, n_tokens: int) -> dict:
    eng = engine(model_dir)
    vocab = eng.runner.model.config.vocab_size
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    eng.grammars.compile(spec)  # compiled once per schema and cached, as in serving
    free = [(p, make_sampling_params(max_new_tokens=n_tokens, ignore_eos=True)) for p in prompts(vocab)]
    constrained = [(p, make_sampling_params(max_new_tokens=n_tokens, grammar=spec)) for p in prompts(vocab)]
    decode_time(eng, free)  # warm-up (kernels, allocator), then alternate
    decode_time(eng, constrained)
    out = {"free": [], "constrained": [], "constrained_steps": []}
    for _ in range(rounds):
        out["free"].append(decode_time(eng, free)[0])
        t, _, steps = decode_time(eng, constrained)
        out["constrained"].append(t)
        out["constrained_steps"].append(steps)
    f, c = statistics.median(out["free"]), statistics.median(out["constrained"])
    return {"free_ms_per_token": f * 1e3, "constrained_ms_per_token": c * 1e3, "ratio": c / f,
            "full_batch_steps": out["constrained_steps"], "raw": out}


def make_adapters(model_dir: Path, folder: Path, count: int, rank: int) -> list[tuple[str, str]]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = []
    for i in range(count):
        torch.manual_seed(100 + i)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        peft = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False,
                                               target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                               "gate_proj", "up_proj", "down_proj"]))
        path = folder / f"adapter{i}"
        peft.save_pretrained(path)
        out.append((f"adapter{i}", str(path)))
    return out


def lora_case(model_dir: Path, rounds: int, n_tokens: int, rank: int = 16) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(model_dir, Path(tmp), 4, rank)
        base_engine = engine(model_dir)
        lora_engine = engine(model_dir, lora_adapters=tuple(adapters))
    vocab = base_engine.runner.model.config.vocab_size
    ps = prompts(vocab, seed=1)
    base = [(p, make_sampling_params(max_new_tokens=n_tokens, ignore_eos=True)) for p in ps]
    mixed = [(p, make_sampling_params(max_new_tokens=n_tokens, ignore_eos=True, adapter=adapters[i % 4][0]))
             for i, p in enumerate(ps)]
    for eng, reqs in ((base_engine, base), (lora_engine, mixed), (lora_engine, base)):
        decode_time(eng, reqs)
    out = {"base": [], "lora4": [], "lora_engine_base": []}
    for _ in range(rounds):
        out["base"].append(decode_time(base_engine, base)[1])
        out["lora4"].append(decode_time(lora_engine, mixed)[1])
        out["lora_engine_base"].append(decode_time(lora_engine, base)[1])
    b, m, w = (statistics.median(out[k]) for k in ("base", "lora4", "lora_engine_base"))
    return {"base_ms_per_step": b * 1e3, "lora4_ms_per_step": m * 1e3, "lora_engine_base_ms_per_step": w * 1e3,
            "ratio": m / b, "rank": rank, "raw": out}


def models() -> dict[str, Path]:
    from kubeshard_shard.demo_model import cached_demo_model

    out = {"demo small (32M)": cached_demo_model(CACHE / "demo-models", arch="llama", size="small", seed=0)}
    smol = sorted((CACHE / "models").glob("SmolLM2-135M*"))
    if smol:
        out["SmolLM2-135M-Instruct"] = smol[0]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--models", choices=["all", "demo"], default="all",
                        help="demo: the small demo model only")
    parser.add_argument("--cases", default="grammar,lora", help="grammar, lora or both (comma-separated)")
    parser.add_argument("--out", default="api", help="result files: bench/results/OUT.md and .json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    results = {"machine": machine(), "command": " ".join(["python -m bench.api_bench"] + sys.argv[1:]),
               "batch": BATCH, "models": {}}
    chosen = models()
    if args.models == "demo":
        chosen = dict(list(chosen.items())[:1])
    for name, path in chosen.items():
        print(f"== {name}", flush=True)
        cases = args.cases.split(",")
        g = grammar_case(path, args.rounds, args.tokens) if "grammar" in cases else None
        if g:
            print(f"grammar: free {g['free_ms_per_token']:.2f} ms/token, constrained "
                  f"{g['constrained_ms_per_token']:.2f} ({g['ratio']:.3f}x)", flush=True)
        lo = lora_case(path, args.rounds, args.tokens) if "lora" in cases else None
        if lo:
            print(f"lora: base {lo['base_ms_per_step']:.1f} ms/step, 4 adapters {lo['lora4_ms_per_step']:.1f} "
                  f"({lo['ratio']:.3f}x), lora engine base rows {lo['lora_engine_base_ms_per_step']:.1f}", flush=True)
        results["models"][name] = {"grammar": g, "lora": lo}
    (RESULTS / f"{args.out}.json").write_text(json.dumps(results, indent=2) + "\n")
    m = results["machine"]
    lines = ["# Structured output and multi-LoRA cost", "",
             f"`{results['command']}` — {m['date']}, {m['cpu']}, {m['cores']} cores, torch {m['torch']}; "
             f"batch {BATCH}, float32 on CPU, {args.tokens} new tokens per request, medians of {args.rounds} "
             "alternating rounds after a warm-up; every figure below comes from this one run.", "",
             "| model | free ms/token | constrained ms/token | ratio (target ≤ 1.10) | base ms/step | "
             "4 adapters ms/step | ratio (target ≤ 1.3) | LoRA engine, base rows ms/step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results["models"].items():
        g, lo = r["grammar"], r["lora"]
        gc = (f"{g['free_ms_per_token']:.2f} | {g['constrained_ms_per_token']:.2f} | **{g['ratio']:.3f}×**"
              if g else "— | — | —")
        lc = (f"{lo['base_ms_per_step']:.1f} | {lo['lora4_ms_per_step']:.1f} | **{lo['ratio']:.3f}×** | "
              f"{lo['lora_engine_base_ms_per_step']:.1f}" if lo else "— | — | — | —")
        lines.append(f"| {name} | {gc} | {lc} |")
    lines += ["", "Constrained rows follow a JSON schema of nested arrays of objects (bounded strings, "
              "integer ranges); the schema is compiled once before timing (the cache), so the figures are "
              "the per-step mask work (xgrammar, `engine/grammar.py`) and its one batched application. "
              "Adapters are rank 16 on q, k, v, o, gate, up and down (PEFT, random weights), four in one "
              "batch of 16 (four rows each); the base engine has no LoRA wrappers at all.", ""]
    (RESULTS / f"{args.out}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
