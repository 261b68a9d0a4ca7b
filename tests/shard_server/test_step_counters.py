"""An engine's running totals (``StepCounters``), shared by the kubeshard engine and the
ONNX Runtime one, and what the kubeshard engine reports through them."""

from __future__ import annotations

import time
from dataclasses import fields

from kubeshard_shard.engine.llm_engine import EngineStats
from kubeshard_shard.engine.step_counters import StepCounters
from tests.support.engine import build_engine, greedy, random_prompts, run_to_completion


def test_keys_steps_and_tokens_count_up():
    c = StepCounters()
    assert [c.new_key() for _ in range(3)] == [0, 1, 2]
    c.token_generated()
    c.token_generated()
    started = time.perf_counter() - 0.01
    c.step_done(started)
    assert c.steps_total == 1 and c.generated_tokens_total == 2
    assert 0.01 <= c.last_step_seconds == c.step_seconds_total < 5
    c.step_done(time.perf_counter())
    assert c.steps_total == 2 and c.step_seconds_total >= c.last_step_seconds + 0.01


def test_totals_are_engine_stats_fields():
    totals = StepCounters(generated_tokens_total=5, steps_total=2).totals()
    assert set(totals) <= {f.name for f in fields(EngineStats)}
    assert totals == {"generated_tokens_total": 5, "steps_total": 2, "last_step_seconds": 0.0,
                      "step_seconds_total": 0.0}
    assert EngineStats(**totals).steps_total == 2


def test_the_engine_reports_its_steps_and_tokens(demo_model):
    served = build_engine(demo_model("llama"))
    outs = run_to_completion(served.engine, [(p, greedy(7)) for p in random_prompts(3, 1000, (5, 12), seed=2)])
    stats = served.engine.stats()
    assert stats.generated_tokens_total == sum(len(o) for o in outs) == 21
    assert stats.steps_total >= 7 and stats.step_seconds_total >= stats.last_step_seconds > 0
    assert served.engine.add_request("x", [5, 6, 7], greedy(1)) == 3   # keys went 0, 1, 2
