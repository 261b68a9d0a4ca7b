"""vLLM's request extensions in the engine (exact counts, on the tiny demo model): ignore_eos,
min_new_tokens, stop_token_ids, logit_bias, min_p, special-token texts, prompt top tokens,
and n sequences per request sharing the prompt's KV blocks, reproducible with a seed."""

from __future__ import annotations

import pytest

from kubeshard_shard.engine.request import RequestError, make_sampling_params
from kubeshard_shard.engine.sequence import FinishReason
from tests.support.engine import build_engine, random_prompts, run_to_completion


@pytest.fixture(scope="module")
def served(demo_model):
    return build_engine(demo_model("llama"), max_total_tokens=512)


def ids(outs):
    return [o.token_id for o in outs]


def one(served, prompt, **kw):
    [outs] = run_to_completion(served.engine, [(prompt, make_sampling_params(**kw))])
    return outs


def by_sequence(outs):
    seqs: dict[int, list] = {}
    for o in outs:
        seqs.setdefault(o.sequence, []).append(o)
    return [seqs[i] for i in sorted(seqs)]


PROMPT = random_prompts(1, 1000, (40, 40), seed=3)[0]


def test_ignore_eos_gives_exactly_max_new_tokens_even_when_eos_is_likeliest(served):
    eos = min(served.tokenizer.eos_ids)
    outs = one(served, PROMPT, max_new_tokens=128, ignore_eos=True, logit_bias={eos: 100.0})
    assert len(outs) == 128 and outs[-1].finish.reason is FinishReason.LENGTH
    assert all(o.token_id == eos for o in outs)  # EOS is emitted, and generation goes on
    # without ignore_eos the same request stops at once
    stopped = one(served, PROMPT, max_new_tokens=128, logit_bias={eos: 100.0})
    assert len(stopped) == 1 and stopped[-1].finish.reason is FinishReason.EOS_TOKEN


def test_min_new_tokens_holds_back_eos_and_stop_tokens(served):
    eos = min(served.tokenizer.eos_ids)
    outs = one(served, PROMPT, max_new_tokens=50, min_new_tokens=7, logit_bias={eos: 100.0})
    # tokens 1..7 may not be EOS; the 8th is EOS (it is by far the likeliest)
    assert len(outs) == 8 and outs[-1].token_id == eos and eos not in ids(outs[:-1])
    assert outs[-1].finish.reason is FinishReason.EOS_TOKEN and outs[-1].finish.generated_tokens == 8
    greedy = ids(one(served, PROMPT, max_new_tokens=1, ignore_eos=True))
    stop = greedy[0]
    held = one(served, PROMPT, max_new_tokens=20, min_new_tokens=4, stop_token_ids=[stop],
               logit_bias={stop: 100.0})
    assert len(held) == 5 and held[-1].finish.reason is FinishReason.STOP_TOKEN


def test_stop_token_ids_end_with_the_token_in_the_output(served):
    first = ids(one(served, PROMPT, max_new_tokens=6, ignore_eos=True))
    outs = one(served, PROMPT, max_new_tokens=20, ignore_eos=True, stop_token_ids=[first[2]])
    assert ids(outs) == first[:first.index(first[2]) + 1]
    assert outs[-1].finish.reason is FinishReason.STOP_TOKEN


def test_logit_bias_applies_to_greedy_rows(served):
    free = ids(one(served, PROMPT, max_new_tokens=4, ignore_eos=True))
    banned = ids(one(served, PROMPT, max_new_tokens=4, ignore_eos=True, logit_bias={free[0]: -100.0}))
    assert banned[0] != free[0]
    forced = ids(one(served, PROMPT, max_new_tokens=4, ignore_eos=True, logit_bias={42: 100.0}))
    assert forced == [42] * 4


def test_min_p_one_keeps_only_the_likeliest_token(served):
    greedy = ids(one(served, PROMPT, max_new_tokens=12, ignore_eos=True))
    sampled = ids(one(served, PROMPT, max_new_tokens=12, ignore_eos=True, do_sample=True, temperature=1.5,
                      seed=7, min_p=1.0))
    assert sampled == greedy


def test_special_token_text_when_not_skipped(served):
    eos = min(served.tokenizer.eos_ids)
    eos_text = served.tokenizer.token_text(eos)
    bias = {eos: 100.0}
    skipped = one(served, PROMPT, max_new_tokens=2, ignore_eos=True, logit_bias=bias)
    assert "".join(o.text for o in skipped) == ""
    kept = one(served, PROMPT, max_new_tokens=2, ignore_eos=True, logit_bias=bias, skip_special_tokens=False)
    assert "".join(o.text for o in kept) == f"{eos_text} {eos_text}"
    tight = one(served, PROMPT, max_new_tokens=2, ignore_eos=True, logit_bias=bias, skip_special_tokens=False,
                spaces_between_special_tokens=False)
    assert "".join(o.text for o in tight) == eos_text * 2


def test_prompt_top_tokens(served):
    outs = one(served, PROMPT[:10], max_new_tokens=1, ignore_eos=True, prefill_details=True,
               prefill_top_n_tokens=3)
    prefill = outs[0].prefill
    assert len(prefill) == 10 and prefill[0].logprob is None and prefill[0].top == []
    for p in prefill[1:]:
        assert len(p.top) == 3 and p.top[0].logprob >= p.top[1].logprob >= p.top[2].logprob
        assert p.logprob <= p.top[0].logprob + 1e-5


def test_n_sequences_are_reproducible_and_sequence_zero_is_the_single_request(served):
    kw = dict(max_new_tokens=16, ignore_eos=True, do_sample=True, temperature=1.0, seed=11)
    [outs] = run_to_completion(served.engine, [(PROMPT, make_sampling_params(n=3, **kw))])
    seqs = by_sequence(outs)
    assert len(seqs) == 3 and all(len(s) == 16 for s in seqs)
    assert [o.done for o in outs].count(True) == 1 and outs[-1].done
    assert len({tuple(ids(s)) for s in seqs}) == 3  # three different samples
    [again] = run_to_completion(served.engine, [(PROMPT, make_sampling_params(n=3, **kw))])
    assert [ids(s) for s in by_sequence(again)] == [ids(s) for s in seqs]
    for i, s in enumerate(seqs):  # sequence i is the one-sequence request with seed + i
        single = one(served, PROMPT, **{**kw, "seed": 11 + i})
        assert ids(single) == ids(s)
        assert s[-1].finish.seed == 11 + i
        assert s[-1].finish.cumulative_logprob == pytest.approx(sum(o.logprob for o in s), rel=1e-4)


def test_n_sequences_share_the_prompt_blocks(demo_model):
    served = build_engine(demo_model("llama"), max_total_tokens=512, enable_prefix_caching=False)
    engine, bm = served.engine, served.engine.block_manager
    prompt = random_prompts(1, 1000, (70, 70), seed=5)[0]  # 4 full blocks of 16 and 6 tokens
    key = engine.add_request("n", prompt, make_sampling_params(max_new_tokens=8, ignore_eos=True, n=4))
    engine.step()  # the first sequence computes the prompt, then the other three start
    request = engine.requests[key]
    first, *others = [s.seq for s in request.states]
    assert len(others) == 3
    shared = first.block_table[:4]
    for child in others:
        assert child.block_table[:4] == shared and child.num_computed_tokens == 64
    assert all(bm.blocks[b].ref_count == 4 for b in shared)
    used_after_fork = bm.num_used_blocks
    engine.step()  # each child computes its 6 tail tokens in a block of its own
    assert bm.num_used_blocks == used_after_fork + 3
    while engine.has_work():
        engine.step()
    assert bm.num_used_blocks == 0
    # greedy: every sequence is the same text
    [outs] = run_to_completion(engine, [(prompt, make_sampling_params(max_new_tokens=8, ignore_eos=True, n=2))])
    a, b = by_sequence(outs)
    assert ids(a) == ids(b)


def test_aborting_an_n_request_frees_every_sequence(served):
    engine = served.engine
    key = engine.add_request("x", PROMPT, make_sampling_params(max_new_tokens=50, ignore_eos=True, n=3))
    engine.step()
    engine.step()
    assert engine.abort(key)
    assert not engine.has_work() and engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("kw, message", [
    (dict(min_p=1.5), "min_p must be in [0, 1]"),
    (dict(min_new_tokens=9), "min_new_tokens must be in [0, max_new_tokens (8)]"),
    (dict(logit_bias={1: 101.0}), "logit_bias[1] must be in [-100, 100]"),
    (dict(n=0), "n must be in [1, 16]"),
])
def test_bad_values_name_the_field(kw, message):
    with pytest.raises(RequestError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        make_sampling_params(max_new_tokens=8, **kw)
