"""Structured output and multi-LoRA cost, measured side by side in one run.

(1) Constrained decoding: 16 requests decoding at once, all free text (``ignore_eos``) or
    all under a JSON schema (xgrammar masks in the batched sampler). The schema asks for
    at least 512 items, so no constrained request can close its JSON (and stop) before
    ``--tokens``: both sides time the same decode steps, at the same context lengths.
    Figure: time per decode step with all 16 running. Target: constrained <= 1.10x free.
(2) Multi-LoRA: 16 requests on the base model of an engine without LoRA, against 16
    requests spread over 4 rank-16 adapters (all seven projections) in one batch; time per
    decode step with all 16 running. Target: <= 1.3x. The LoRA engine serving only base
    requests is shown too (the wrappers' own cost: its steps go through the fused decode
    step, as the base engine's), and the same through the modules
    (``lora_engine_base_modules``: the fused step off, as every LoRA engine served base
    rows before it took them). The mixed batch is also timed through the modules with the
    deltas' CPU kernel (``lora4_modules``) and with the torch path's masked GEMMs
    (``lora4_torch_modules``: how every step with adapter rows ran before the kernel).
    ``--batch`` changes the 16 (``--cases lora`` alone: the grammar case's schema is
    sized for 16).

Each pair alternates over ``--rounds`` rounds after a warm-up; a round's figure is the
median of its full-batch steps. The table gives the median round, the spread (min-max
over rounds) and the ratio of medians; the load average before and after the run is
recorded, since on a shared machine the spread, not the median, says how far to trust
it. ``--threads 1`` also records each step's CPU time of the engine thread, which the
load of other processes barely moves. Models: the ``small`` demo model (~32M) and, when
its conversion is cached, the default SmolLM2-135M-Instruct (``--models all``).

    python -m bench.api_bench [--rounds 5] [--tokens 64] [--models all|demo] [--threads 2] [--batch 16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import types
import time
from pathlib import Path

import torch

from bench.common import CACHE, RESULTS, machine
from kubeshard_shard.config import EngineConfig, MemoryBudget
from kubeshard_shard.engine.request import make_sampling_params
from kubeshard_shard.engine.sequence import GrammarSpec
from kubeshard_shard.server.factory import build_served_model

BATCH = 16
# at least 512 items of >= 15 tokens each: no request can close it within --tokens
SCHEMA = {"type": "object", "properties": {
    "items": {"type": "array", "minItems": 512, "maxItems": 1024, "items": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 48},
        "score": {"type": "integer", "minimum": 0, "maximum": 1000},
        "tags": {"type": "array", "maxItems": 8, "items": {"type": "string", "maxLength": 16}}},
        "required": ["name", "score", "tags"]}}},
    "required": ["items"]}


def engine(model_dir: Path, threads: int, **kw):
    config = EngineConfig(model_dir=model_dir, model_id=model_dir.name, kv_cache_memory=MemoryBudget.parse("512MiB"),
                          max_total_tokens=1024, num_threads=threads, **kw)
    return build_served_model(config).engine


def prompts(vocab: int, n: int = BATCH, length: int = 32, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n, length), generator=g).tolist()


def decode_steps(eng, requests) -> dict:
    """Per-step wall and engine-thread CPU seconds over the steps with the whole batch
    decoding, and how many tokens each request got."""
    index = {eng.add_request(str(i), ids, params): i for i, (ids, params) in enumerate(requests)}
    wall, cpu, tokens = [], [], [0] * len(requests)
    while eng.has_work():
        full = len(eng.scheduler.running) == len(requests) and all(
            s.num_uncomputed_tokens == 1 for s in eng.scheduler.running)
        t0, c0 = time.perf_counter(), time.thread_time()
        outs = eng.step()
        dt, dc = time.perf_counter() - t0, time.thread_time() - c0
        for o in outs:
            tokens[index[o.request_key]] += 1
        if full and len(outs) == len(requests):
            wall.append(dt)
            cpu.append(dc)
    return {"wall": wall, "cpu": cpu, "tokens": tokens}


def _rounds(cases: dict, rounds: int) -> dict:
    """Alternates the cases ``rounds`` times after one warm-up each; per case and round,
    the median step (wall, cpu), the steps timed and the tokens per request."""
    for eng, reqs in cases.values():
        decode_steps(eng, reqs)
    out = {name: {"wall": [], "cpu": [], "steps": [], "tokens": []} for name in cases}
    for _ in range(rounds):
        for name, (eng, reqs) in cases.items():
            r = decode_steps(eng, reqs)
            out[name]["wall"].append(statistics.median(r["wall"]) if r["wall"] else float("nan"))
            out[name]["cpu"].append(statistics.median(r["cpu"]) if r["cpu"] else float("nan"))
            out[name]["steps"].append(len(r["wall"]))
            out[name]["tokens"].append(sorted(set(r["tokens"])))
    return out


def _summary(raw: dict, base: str) -> dict:
    def stats(v):
        return {"median_ms": statistics.median(v) * 1e3, "min_ms": min(v) * 1e3, "max_ms": max(v) * 1e3}

    out = {name: {"wall": stats(r["wall"]), "cpu": stats(r["cpu"]), "steps": r["steps"], "tokens": r["tokens"]}
           for name, r in raw.items()}
    for name, r in out.items():
        for clock in ("wall", "cpu"):
            r[clock]["ratio"] = r[clock]["median_ms"] / out[base][clock]["median_ms"]
            r[clock]["ratio_min"] = r[clock]["min_ms"] / out[base][clock]["min_ms"]
    return out


class XgrammarMasks:
    """The CPU kernels' module with the step's grammar masks filled one matcher at a time
    and applied by xgrammar's kernel: how the sampler did it before ``csrc/grammar_mask.cpp``."""

    def __init__(self, module) -> None:
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)

    def apply_bitmask_(self, logits, mask, rows) -> None:
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=min(logits.shape[1], mask.shape[1] * 32),
                                        indices=rows)


def fill_one_at_a_time(self, seqs):
    rows = [i for i, s in enumerate(seqs) if s.matcher is not None]
    if not rows:
        return None
    mask = self.bitmask(len(seqs))
    for i in rows:
        seqs[i].matcher.fill_next_token_bitmask(mask, i)
    return mask, rows


def grammar_case(model_dir: Path, rounds: int, n_tokens: int, threads: int) -> dict:
    eng = engine(model_dir, threads)
    before = engine(model_dir, threads)
    before.sampler.kernels = XgrammarMasks(before.sampler.kernels)
    before.sampler.masks.fill = types.MethodType(fill_one_at_a_time, before.sampler.masks)
    vocab = eng.runner.model.config.vocab_size
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    eng.grammars.compile(spec)  # compiled once per schema and cached, as in serving
    before.grammars.compile(spec)
    free = [(p, make_sampling_params(max_new_tokens=n_tokens, ignore_eos=True)) for p in prompts(vocab)]
    constrained = [(p, make_sampling_params(max_new_tokens=n_tokens, grammar=spec)) for p in prompts(vocab)]
    raw = _rounds({"free": (eng, free), "constrained": (eng, constrained),
                   "constrained_xgrammar": (before, constrained)}, rounds)
    if raw["constrained"]["tokens"] != raw["free"]["tokens"]:
        raise RuntimeError(f"constrained requests stopped early: tokens {raw['constrained']['tokens']} against "
                           f"{raw['free']['tokens']}; the schema must not close within --tokens")
    return {"summary": _summary(raw, "free"), "raw": raw}


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


def lora_case(model_dir: Path, rounds: int, n_tokens: int, threads: int, rank: int = 16, batch: int = BATCH) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(model_dir, Path(tmp), 4, rank)
        base_engine = engine(model_dir, threads)
        lora_engine = engine(model_dir, threads, lora_adapters=tuple(adapters))
        modules_engine = engine(model_dir, threads, lora_adapters=tuple(adapters))
        torch_engine = engine(model_dir, threads, lora_adapters=tuple(adapters))
    modules_engine.runner.fused = None  # every step through the modules
    torch_engine.runner.fused = None
    for pack in torch_engine.runner.lora.packs.values():
        pack.native = None  # LoraLinear takes the torch path (models/lora.py)
    vocab = base_engine.runner.model.config.vocab_size
    ps = prompts(vocab, n=batch, seed=1)
    base = [(p, make_sampling_params(max_new_tokens=n_tokens, ignore_eos=True)) for p in ps]
    mixed = [(p, make_sampling_params(max_new_tokens=n_tokens, ignore_eos=True, adapter=adapters[i % 4][0]))
             for i, p in enumerate(ps)]
    raw = _rounds({"base": (base_engine, base), "lora4": (lora_engine, mixed),
                   "lora4_modules": (modules_engine, mixed), "lora4_torch_modules": (torch_engine, mixed),
                   "lora_engine_base": (lora_engine, base), "lora_engine_base_modules": (modules_engine, base)},
                  rounds)
    return {"summary": _summary(raw, "base"), "rank": rank, "raw": raw}


def models() -> dict[str, Path]:
    from kubeshard_shard.demo_model import cached_demo_model

    out = {"demo small (32M)": cached_demo_model(CACHE / "demo-models", arch="llama", size="small", seed=0)}
    smol = sorted(p for p in (CACHE / "models").glob("SmolLM2-135M*") if p.is_dir())
    if smol:
        out["SmolLM2-135M-Instruct"] = smol[0]
    return out


def _cell(r: dict, clock: str) -> str:
    s = r[clock]
    return f"{s['median_ms']:.1f} ({s['min_ms']:.1f}-{s['max_ms']:.1f})"


def report(results: dict, args) -> str:
    m = results["machine"]
    lines = ["# Structured output and multi-LoRA cost", "",
             f"`{results['command']}` — {m['date']}, {m['cpu']}, {m['cores']} cores, torch {m['torch']}; "
             f"batch {results.get('batch', BATCH)}, float32 on CPU, {args.threads} thread(s), "
             f"{args.tokens} new tokens per request, "
             f"{args.rounds} alternating rounds after a warm-up; load average {results['load_before']} before, "
             f"{results['load_after']} after. Every figure below comes from this one run.", "",
             "Step times in ms: median round (min-max over rounds); ratios are of the medians (and of the "
             "minima). CPU: the engine thread's CPU time per step (meaningful with --threads 1).", "",
             "| model | case | wall ms/step | ratio | CPU ms/step | ratio | full-batch steps | target |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for name, r in results["models"].items():
        for case, base, target, rows in (("grammar", "free", "≤ 1.10", ("constrained", "constrained_xgrammar")),
                                         ("lora", "base", "≤ 1.3",
                                          ("lora4", "lora4_modules", "lora4_torch_modules", "lora_engine_base",
                                           "lora_engine_base_modules"))):
            if r.get(case) is None:
                continue
            s = r[case]["summary"]
            lines.append(f"| {name} | {base} | {_cell(s[base], 'wall')} | 1 | {_cell(s[base], 'cpu')} | 1 | "
                         f"{s[base]['steps'][0]} | |")
            for row in rows:
                x = s[row]
                lines.append(f"| {name} | {row} | {_cell(x, 'wall')} | **{x['wall']['ratio']:.3f}×** "
                             f"({x['wall']['ratio_min']:.3f}) | {_cell(x, 'cpu')} | {x['cpu']['ratio']:.3f}× "
                             f"({x['cpu']['ratio_min']:.3f}) | {x['steps'][0]} | "
                             f"{target if row in ('constrained', 'lora4') else ''} |")
    lines += ["", "Constrained rows follow a JSON schema of at least 512 objects (bounded strings, integer "
              "ranges, nested arrays), so every constrained request runs all its tokens, as the free ones do "
              "with ignore_eos; the schema is compiled once before timing (the cache), so the figures are the "
              "per-step mask work (xgrammar's matchers in one batched call, `engine/grammar.py`) and its "
              "application by the CPU kernel (`engine/csrc/grammar_mask.cpp`); `constrained_xgrammar` is the same "
              "batch with each row's mask filled in its own call and applied by xgrammar's CPU kernel (how every "
              "constrained step ran before). Adapters "
              f"are rank 16 on q, k, v, o, gate, up and down (PEFT, random weights), four in one batch of "
              f"{results.get('batch', BATCH)} (a quarter of the rows each), stacked per layer (`models/lora.py`); "
              "`lora4` runs their deltas with the CPU kernel (`engine/csrc/lora.cpp`) inside the fused decode "
              "step, `lora4_modules` with the same kernel through the modules (the fused step off), "
              "`lora4_torch_modules` through the modules with the torch path's masked GEMMs; the base engine has "
              "no LoRA wrappers at all; `lora_engine_base` is the LoRA engine serving base rows (through the fused "
              "decode step), `lora_engine_base_modules` the same with that step off (through the modules).", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the engines")
    parser.add_argument("--models", choices=["all", "demo"], default="all",
                        help="demo: the small demo model only")
    parser.add_argument("--cases", default="grammar,lora", help="grammar, lora or both (comma-separated)")
    parser.add_argument("--out", default="api", help="result files: bench/results/OUT.md and .json")
    parser.add_argument("--batch", type=int, default=BATCH, help="requests decoding at once (the lora case)")
    args = parser.parse_args()
    if args.rounds < 1 or args.tokens < 4 or args.batch < 1:
        raise SystemExit("--rounds must be >= 1, --tokens >= 4 and --batch >= 1")
    if args.batch != BATCH and "grammar" in args.cases.split(","):
        raise SystemExit(f"--batch applies to --cases lora only (the grammar case runs {BATCH})")
    torch.set_num_threads(args.threads)
    results = {"machine": machine(), "command": " ".join(["python -m bench.api_bench"] + sys.argv[1:]),
               "batch": args.batch, "threads": args.threads, "load_before": [round(x, 2) for x in os.getloadavg()],
               "models": {}}
    chosen = models()
    if args.models == "demo":
        chosen = dict(list(chosen.items())[:1])
    cases = args.cases.split(",")
    for name, path in chosen.items():
        print(f"== {name}", flush=True)
        g = grammar_case(path, args.rounds, args.tokens, args.threads) if "grammar" in cases else None
        if g:
            s = g["summary"]
            print(f"grammar: free {_cell(s['free'], 'wall')} ms/step, constrained {_cell(s['constrained'], 'wall')} "
                  f"({s['constrained']['wall']['ratio']:.3f}x)", flush=True)
        lo = lora_case(path, args.rounds, args.tokens, args.threads, batch=args.batch) if "lora" in cases else None
        if lo:
            s = lo["summary"]
            print(f"lora: base {_cell(s['base'], 'wall')} ms/step, 4 adapters {_cell(s['lora4'], 'wall')} "
                  f"({s['lora4']['wall']['ratio']:.3f}x)", flush=True)
        results["models"][name] = {"grammar": g, "lora": lo}
    results["load_after"] = [round(x, 2) for x in os.getloadavg()]
    (RESULTS / f"{args.out}.json").write_text(json.dumps(results, indent=2) + "\n")
    text = report(results, args)
    (RESULTS / f"{args.out}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
