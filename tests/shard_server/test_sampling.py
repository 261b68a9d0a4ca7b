"""Sampling: seeded draws are reproducible and independent of batch mates; filters behave."""

from __future__ import annotations

import pytest
import torch

from kubeshard_shard.engine.request import make_sampling_params
from kubeshard_shard.engine.sampler import Sampler, filter_logits
from kubeshard_shard.engine.sequence import Sequence
from tests.support.engine import build_engine, greedy, random_prompts, run_to_completion


def sampled(seed, n=24, **kw):
    return make_sampling_params(max_new_tokens=n, do_sample=True, temperature=1.0, seed=seed, ignore_eos=True, **kw)


def tokens(outs):
    return [o.token_id for o in outs]


def test_seeded_sampling_is_reproducible_and_independent_of_batch_mates(demo_model):
    served = build_engine(demo_model("llama"))
    prompt = random_prompts(1, 1000, (30, 30), seed=9)[0]
    [alone] = run_to_completion(served.engine, [(prompt, sampled(1234))])
    mates = [(p, sampled(s)) for s, p in enumerate(random_prompts(7, 1000, (5, 120), seed=10))]
    batch = run_to_completion(served.engine, mates[:3] + [(prompt, sampled(1234))] + mates[3:])
    assert tokens(alone) == tokens(batch[3])
    [other_seed] = run_to_completion(served.engine, [(prompt, sampled(99))])
    assert tokens(other_seed) != tokens(alone)
    assert alone[-1].finish.seed == 1234


def test_unseeded_sampling_reports_the_seed_it_used(demo_model):
    served = build_engine(demo_model("llama"))
    prompt = [5, 6, 7]
    params = make_sampling_params(max_new_tokens=12, do_sample=True, ignore_eos=True)
    [first] = run_to_completion(served.engine, [(prompt, params)])
    seed = first[-1].finish.seed
    assert seed is not None
    [again] = run_to_completion(served.engine, [(prompt, sampled(seed, 12))])
    assert tokens(again) == tokens(first)


def test_top_k_one_and_tiny_top_p_equal_greedy(demo_model):
    served = build_engine(demo_model("qwen2"))
    prompt = random_prompts(1, 1000, (20, 20), seed=11)[0]
    [g] = run_to_completion(served.engine, [(prompt, greedy(16))])
    [k1] = run_to_completion(served.engine, [(prompt, sampled(5, 16, top_k=1))])
    [p0] = run_to_completion(served.engine, [(prompt, sampled(6, 16, top_p=1e-6))])
    assert tokens(g) == tokens(k1) == tokens(p0)


def test_repetition_penalty_changes_the_output(demo_model):
    served = build_engine(demo_model("llama"))
    prompt = [9, 9, 9, 9, 9, 9, 9, 9]
    [plain] = run_to_completion(served.engine, [(prompt, greedy(24))])
    [penal] = run_to_completion(served.engine, [(prompt, greedy(24, repetition_penalty=5.0))])
    assert tokens(plain) != tokens(penal)
    # with a strong frequency penalty no token repeats in a short output
    [freq] = run_to_completion(served.engine, [(prompt, greedy(20, frequency_penalty=2.0, presence_penalty=2.0))])
    assert len(set(tokens(freq))) >= 18


def test_filters_keep_the_right_tokens():
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0])
    p = make_sampling_params(max_new_tokens=1, do_sample=True, top_k=2, seed=0)
    assert torch.isfinite(filter_logits(logits, p)).tolist() == [False, False, False, True, True]
    p = make_sampling_params(max_new_tokens=1, do_sample=True, top_p=0.5, seed=0)
    kept = torch.isfinite(filter_logits(logits, p)).tolist()
    assert kept == [False, False, False, False, True]  # softmax mass of 4.0 alone is 0.64
    p = make_sampling_params(max_new_tokens=1, do_sample=True, typical_p=0.2, seed=0)
    assert torch.isfinite(filter_logits(logits, p)).sum() >= 1


def test_logprobs_and_top_alternatives():
    sampler = Sampler()
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0]])
    seq = Sequence("x", [1], make_sampling_params(max_new_tokens=1, top_n_tokens=2))
    [tok] = sampler(logits, [seq])
    expected = torch.log_softmax(logits[0], -1)
    assert tok.token_id == 2
    assert tok.logprob == pytest.approx(expected[2].item())
    assert [t for t, _ in tok.top] == [2, 3]
