"""How n-gram proposals would fare on the default model's real answers, replayed: the
evidence behind the proposal rules of ``engine/ngram.py`` and ``engine/speculative.py``.

Greedy answers are fixed, so whether a proposal would be kept is known without running
it: this takes the greedy answers to the speculative benchmark's prompts (one in-process
engine, float32, at most 128 tokens), then

1. measures a step's time against its rows: one sequence decoding with a verification of
   j proposals, every j in turn step after step (an oracle proposes the answer's own next
   tokens, so all are kept and the rows are exactly j + 1), medians over the answers;
2. counts, at every position of every answer, how often the n-gram lookup's i-th proposal
   would be kept, by how long the match it came from is (the match extended backwards);
3. replays each answer through the engine's own ``lookup`` and ``Speculator`` (a sequence
   decoding alone, as at 1 client) with the proposal lengths adapting and without, and
   prices every step with (1): decode speed-up = tokens / the steps' cost, where a plain
   decode step costs 1. Prefill is not in it (``speculative_bench`` measures end to end).

    python -m bench.ngram_replay [--max-tokens 128] [--k 6] [--render]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from bench.common import isa_results, load_average_lines, machine, md_table, rerender, write_results
from bench.speculative_bench import COPY_HEAVY, FREE_CHAT, chat_ids
from kubeshard_shard.engine.ngram import NgramProposer, latest_match, lookup
from kubeshard_shard.engine.request import make_sampling_params
from kubeshard_shard.engine.sequence import Sequence
from kubeshard_shard.engine.speculative import Speculator

MIN_N, MAX_N = 1, 4  # the benchmark's ngram-min1 configuration
MATCH_BUCKETS = ((1, 1), (2, 2), (3, 4), (5, 8), (9, 10**9))  # extended match lengths, inclusive


class Oracle:
    """Proposes the next ``j`` tokens of each sequence's known answer (``seq.answer``), ``j``
    cycling 0, 1, ..., k from step to step: every proposal kept, rows exactly j + 1."""

    name, free = "oracle", True

    def __init__(self, k: int) -> None:
        self.k, self.turn, self.last = k, 0, 0

    def propose(self, lane_index, batch) -> None:
        for seq, budget in batch:
            j = self.turn % (self.k + 1)
            self.turn += 1
            seq.spec_tokens = seq.answer[seq.num_output_tokens:][:min(j, budget)]
            seq.spec_probs = None
            self.last = len(seq.spec_tokens)

    def verified(self, *args) -> None:
        pass


def engine_with(k: int):
    from pathlib import Path

    from kubeshard_shard.checkpoints import default_model_file, local_checkpoint
    from kubeshard_shard.config import SpeculativeConfig
    from tests.support.engine import build_engine

    model = local_checkpoint(default_model_file())
    served = build_engine(Path(model), kv="512MiB", enable_prefix_caching=False,
                          speculative=SpeculativeConfig(method="ngram", num_tokens=k, ngram_min=MIN_N, ngram_max=MAX_N))
    return model, served.engine


def answers(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    out = []
    for ids in prompts:
        engine.add_request("a", ids, make_sampling_params(max_new_tokens=max_tokens))
        tokens = []
        while engine.has_work():
            tokens += [o.token_id for o in engine.step()]
        out.append(tokens)
    return out


def step_costs(engine, prompts, answers_, k: int) -> list[float]:
    """Median step time with j proposals over that with none, j = 0..k."""
    oracle = Oracle(k)
    engine.speculator.proposer, saved = oracle, engine.speculator.proposer
    times: dict[int, list[float]] = {j: [] for j in range(k + 1)}
    try:
        for ids, answer in zip(prompts, answers_):
            engine.add_request("c", ids, make_sampling_params(max_new_tokens=len(answer), ignore_eos=True))
            engine.step()  # the prefill
            for lane in engine.lanes:
                for seq in lane.scheduler.running:
                    seq.answer = answer + [0] * (k + 1)
            while engine.has_work():
                started = time.perf_counter()
                emitted = len(engine.step())
                if emitted == oracle.last + 1:  # not cut short by the answer's end
                    times[oracle.last].append(time.perf_counter() - started)
    finally:
        engine.speculator.proposer = saved
    base = statistics.median(times[0])
    return [statistics.median(times[j]) / base if times[j] else float("nan") for j in range(k + 1)]


def match_length(tokens: np.ndarray, end: int) -> int:
    """How many tokens up to ``end`` equal those up to the last one."""
    n, last = 0, len(tokens) - 1
    while end - n >= 0 and end - n != last - n and tokens[end - n] == tokens[last - n]:
        n += 1
    return n


def acceptance_by_match(prompts, answers_, k: int) -> dict[str, list[float]]:
    """For each bucket of match length: [positions, P(1st kept), P(1st and 2nd kept), ...]
    (every position of every answer; proposals uncapped, up to ``k``)."""
    counts = {b: [0] * (k + 1) for b in MATCH_BUCKETS}
    for ids, answer in zip(prompts, answers_):
        for pos in range(1, len(answer)):
            tokens = np.asarray(ids + answer[:pos], dtype=np.int64)
            found = latest_match(tokens, MIN_N, MAX_N)  # the match the lookup proposes from
            if found is None:
                continue
            end = found[1]
            length = match_length(tokens, end)  # extended past MAX_N
            bucket = next(b for b in MATCH_BUCKETS if b[0] <= length <= b[1])
            follow = tokens[end + 1:end + 1 + k].tolist()
            kept = 0
            while kept < len(follow) and pos + kept < len(answer) and follow[kept] == answer[pos + kept]:
                kept += 1
            counts[bucket][0] += 1
            for i in range(1, kept + 1):
                counts[bucket][i] += 1
    return {f"{lo}" if lo == hi else f"{lo}+" if hi > 10**8 else f"{lo}-{hi}":
            [c[0]] + [c[i] / c[0] if c[0] else 0.0 for i in range(1, k + 1)] for (lo, hi), c in counts.items()}


def replay(prompts, answers_, k: int, max_tokens: int, costs: list[float], adaptive: bool) -> dict:
    """The engine's lookup and Speculator over every answer, a sequence alone; with
    ``adaptive`` its proposal lengths shrink after refusals as they do in a batch."""
    steps = tokens = 0
    cost = 0.0
    for ids, answer in zip(prompts, answers_):
        spec = Speculator(NgramProposer(MIN_N, MAX_N), k)
        seq = Sequence("r", list(ids), make_sampling_params(max_new_tokens=max_tokens))
        seq.token_ids.append(answer[0])  # the prefill's token
        done = 1
        while done < len(answer):
            budget = spec.lookahead(seq, running=2 if adaptive else 1)
            proposed = lookup(np.asarray(seq.token_ids, dtype=np.int64), budget, MIN_N, MAX_N) if budget else []
            kept = 0
            while kept < len(proposed) and done + kept < len(answer) and proposed[kept] == answer[done + kept]:
                kept += 1
            if proposed:
                spec.verified(seq, len(seq.token_ids) - 1, len(proposed), kept)
            emitted = min(kept + 1, len(answer) - done)
            seq.token_ids.extend(answer[done:done + emitted])
            done += emitted
            steps += 1
            tokens += emitted
            cost += costs[len(proposed)]
    return {"tokens": tokens, "steps": steps, "tokens_per_step": tokens / steps, "speed_up": tokens / cost}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=6, help="proposals per step at most (--num-speculative-tokens)")
    parser.add_argument("--render", action="store_true")
    args = parser.parse_args()
    name = isa_results("ngram-replay")
    if args.render:
        rerender(name, render)
        return
    from transformers import AutoTokenizer

    load_before = os.getloadavg()[0]
    model, engine = engine_with(args.k)
    tokenizer = AutoTokenizer.from_pretrained(model)
    workloads = {"copy-heavy": COPY_HEAVY, "free chat": FREE_CHAT}
    prompts = {kind: [chat_ids(tokenizer, t) for t in texts] for kind, texts in workloads.items()}
    got = {kind: answers(engine, ids, args.max_tokens) for kind, ids in prompts.items()}
    costs = step_costs(engine, prompts["free chat"], got["free chat"], args.k)
    results = {"machine": machine(), "k": args.k, "ngram": [MIN_N, MAX_N], "max_tokens": args.max_tokens,
               "command": f"python -m bench.ngram_replay --max-tokens {args.max_tokens} --k {args.k}",
               "step_cost": costs, "workloads": {}}
    for kind in workloads:
        results["workloads"][kind] = {
            "answer_tokens": [len(a) for a in got[kind]],
            "acceptance_by_match": acceptance_by_match(prompts[kind], got[kind], args.k),
            "adaptive": replay(prompts[kind], got[kind], args.k, args.max_tokens, costs, adaptive=True),
            "alone": replay(prompts[kind], got[kind], args.k, args.max_tokens, costs, adaptive=False)}
    results["load_average_1m"] = {"before": load_before, "after": os.getloadavg()[0]}
    write_results(name, results, render(results))


def render(r: dict) -> str:
    m, k = r["machine"], r["k"]
    lines = ["# N-gram proposals replayed on the default model's answers", "",
             f"`{r['command']}` — {m['date']}, {m['cpu']}, {m['cores']} cores, torch {m['torch']}.", "",
             f"SmolLM2-135M-Instruct in float32, greedy answers (at most {r['max_tokens']} tokens) to the speculative "
             f"benchmark's prompts; n-gram lookups of {r['ngram'][0]}-{r['ngram'][1]} tokens, at most {k} proposals.",
             "", "## A step's time against its verification rows", "",
             "One sequence decoding, its step verifying j proposals (j + 1 rows), over a step of one row; median "
             "over the free-chat answers, every j in turn step after step.", "",
             *md_table(["proposals", *map(str, range(k + 1))],
                       [["step time", *(f"{c:.3f}" for c in r["step_cost"])]], right=True, left=(0,)), ""]
    for kind, w in r["workloads"].items():
        lines += [f"## {kind}", "", f"Answers of {min(w['answer_tokens'])}-{max(w['answer_tokens'])} tokens "
                  f"({sum(w['answer_tokens'])} in all). How often the i-th proposal would be kept (with every one "
                  "before it), at every position, by the length of the match it follows:", "",
                  *md_table(["match tokens", "positions", *(f"{i}" for i in range(1, k + 1))],
                            [[b, v[0], *(f"{p:.0%}" for p in v[1:])] for b, v in w["acceptance_by_match"].items()],
                            right=True, left=(0,)), "",
                  "The engine's lookup and proposal lengths replayed (a sequence alone), each step priced by the "
                  "table above:", "",
                  *md_table(["proposal lengths", "steps", "tokens per step", "decode speed-up"],
                            [[label, w[key]["steps"], f"{w[key]['tokens_per_step']:.2f}",
                              f"{w[key]['speed_up']:.2f}×"]
                             for key, label in (("alone", "up to k each step (a sequence alone)"),
                                                ("adaptive", "shrinking after refusals (as in a batch)"))],
                            right=True, left=(0,)), ""]
    lines += load_average_lines(r)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
