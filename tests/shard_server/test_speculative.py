"""Speculative decoding: n-gram and draft-model proposals verified in one pass.

What must hold: greedy output is token for token what decoding one token at a time
gives (alone, batched, with preemption, with a cached prefix, in tensor and zero3
groups); sampled output with a seed is reproducible; and the tokens it samples follow
the same distribution as sampling without speculation (rejection sampling, shown on
the verification step alone and on the engine end to end).
"""

from __future__ import annotations

import math
import shutil
from collections import Counter

import numpy as np
import pytest
import requests
import torch
from safetensors.torch import load_file, save_file

from kubeshard_proto import pb
from kubeshard_shard.config import EngineConfig, SpeculativeConfig
from kubeshard_shard.engine.ngram import SHORT_MATCH, SHORT_MATCH_TOKENS, NgramProposer, lookup
from kubeshard_shard.engine.rejection import accept_or_resample, race
from kubeshard_shard.engine.request import make_sampling_params
from kubeshard_shard.engine.sequence import Sequence
from kubeshard_shard.engine.speculative import Speculator
from kubeshard_shard.server.factory import build_served_model

from tests.support.engine import build_engine, greedy, hf_greedy, random_prompts, run_to_completion
from tests.support.shard_process import start_group, start_shard

K = 4


def token_ids(outputs) -> list[list[int]]:
    return [[o.token_id for o in outs] for outs in outputs]


def copy_heavy(prompts: list[list[int]]) -> list[list[int]]:
    """Prompts whose continuations tend to repeat their own runs (n-gram proposals find
    matches), as edits and extractions do."""
    return [p + p[:12] + p for p in prompts]


def chi_square_same(a: Counter, b: Counter) -> tuple[float, int]:
    """Pearson's two-sample chi-square statistic over the categories seen, and its
    degrees of freedom (categories rarer than 5 in total are pooled)."""
    na, nb = sum(a.values()), sum(b.values())
    cats = sorted(set(a) | set(b), key=lambda c: -(a[c] + b[c]))
    big = [c for c in cats if a[c] + b[c] >= 5]
    rows = [(a[c], b[c]) for c in big]
    rest = (na - sum(x for x, _ in rows), nb - sum(y for _, y in rows))
    if sum(rest):
        rows.append(rest)
    stat = 0.0
    for x, y in rows:
        total = x + y
        ea, eb = total * na / (na + nb), total * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    return stat, len(rows) - 1


def chi_square_critical(df: int) -> float:
    """The 0.999 quantile of chi-square with ``df`` degrees of freedom (Wilson-Hilferty)."""
    z = 3.090
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


# ---- proposals ---------------------------------------------------------------------
def test_ngram_lookup_proposes_what_followed_the_latest_longest_match():
    tokens = np.array([5, 6, 7, 8, 9, 1, 2, 3, 5, 6, 7, 4, 4, 2, 3, 5, 6])
    # the suffix [3, 5, 6] (3 tokens) occurred once, at 6..8 of the earlier text: 7, 4, 4 followed
    assert lookup(tokens, 3, 1, 3) == [7, 4, 4]
    # only 1-2 token suffixes: [5, 6] occurs at 0..1 and 8..9; the latest (8..9) wins
    assert lookup(tokens, 2, 1, 2) == [7, 4]
    assert lookup(np.array([1, 2, 3, 4]), 3, 1, 3) == []  # no earlier occurrence
    assert lookup(np.array([1, 2, 1]), 5, 1, 3) == [2, 1]   # what exists, fewer than k
    assert lookup(tokens, 0, 1, 3) == []


def test_a_match_shorter_than_three_tokens_proposes_at_most_two():
    tokens = np.array([9, 1, 2, 3, 4, 5, 6, 9])  # only [9] occurred before
    assert (SHORT_MATCH, SHORT_MATCH_TOKENS) == (3, 2)
    assert lookup(tokens, 6, 1, 3) == [1, 2]
    assert lookup(tokens, 1, 1, 3) == [1]
    assert lookup(tokens, 6, 2, 3) == []  # shorter than the shortest suffix looked up
    two = np.array([8, 9, 1, 2, 3, 4, 5, 6, 8, 9])  # [8, 9] occurred: two tokens, still short
    assert lookup(two, 6, 1, 3) == [1, 2]
    assert lookup(two, 6, 1, 2) == [1, 2, 3, 4, 5, 6]  # two is the longest looked for: it counts as long
    three = np.array([7, 8, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9])  # [7, 8, 9] occurred: k
    assert lookup(three, 6, 1, 3) == [1, 2, 3, 4, 5, 6]


class _Costly(NgramProposer):
    """An n-gram proposer that claims its proposals cost a model step each, as a draft's do."""

    free = False


def test_a_lone_sequence_with_free_proposals_always_may_propose_k():
    seq = Sequence("r", [1, 2, 3], make_sampling_params(max_new_tokens=100))
    spec = Speculator(NgramProposer(1, 3), num_tokens=6)
    assert spec.lookahead(seq, running=1) == 6
    spec.verified(seq, position=3, proposed=6, kept=0)  # refused at once
    assert spec.lookahead(seq, running=1) == 6  # alone: a verification row is cheap, k again
    assert spec.lookahead(seq, running=2) == 1  # in a batch: it adapts (below)


@pytest.mark.parametrize("proposer, running", [(NgramProposer(1, 3), 2), (_Costly(1, 3), 1)],
                         ids=["ngram in a batch", "costly proposals alone"])
def test_proposals_shrink_after_a_refusal_and_grow_back_while_kept(proposer, running):
    seq = Sequence("r", [1, 2, 3], make_sampling_params(max_new_tokens=100))
    spec = Speculator(proposer, num_tokens=6)
    assert spec.lookahead(seq, running) == 6  # the configured number first
    spec.verified(seq, position=3, proposed=6, kept=2)  # refused at the third: 2 kept + 1
    assert spec.lookahead(seq, running) == 3
    spec.verified(seq, position=6, proposed=3, kept=0)  # refused at once: 1
    assert spec.lookahead(seq, running) == 1
    for proposed, want in [(1, 2), (2, 4), (4, 6), (6, 6)]:  # kept whole: doubled, up to 6
        spec.verified(seq, position=10, proposed=proposed, kept=proposed)
        assert spec.lookahead(seq, running) == want
    # the request's token budget still caps it: 3 tokens left, room for 2 proposals and one more
    seq.token_ids += [0] * 97
    assert seq.num_output_tokens == 97 and spec.lookahead(seq, running) == 2
    assert spec.lookahead(seq, 1) == 2  # alone with free proposals too
    stats = spec.stats()
    assert (stats.drafts, stats.draft_tokens, stats.accepted_tokens) == (6, 22, 15)


# ---- verification keeps the target distribution ---------------------------------------
@pytest.mark.parametrize("kind", ["certain draft", "draft distribution"])
def test_rejection_sampling_emits_the_target_distribution(kind):
    """Whatever the proposal, the emitted token is distributed as p (20,000 seeded draws)."""
    gen = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(8, generator=gen) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(8, generator=gen) * 1.5, dim=-1)
    counts = torch.zeros(8)
    draws = 20_000
    for _ in range(draws):
        if kind == "certain draft":
            draft, dist = 3, None
        else:
            draft, dist = race(q, gen), q
        other = accept_or_resample(p, dist, draft, gen)
        counts[draft if other is None else other] += 1
    expected = p * draws
    stat = float(((counts - expected) ** 2 / expected).sum())
    assert stat < chi_square_critical(7), (counts / draws, p)


# ---- greedy identity ----------------------------------------------------------------
@pytest.fixture(scope="module")
def other_draft(demo_model, tmp_path_factory):
    """A draft of the target's tokenizer with other weights (the target's, each scaled by
    a seeded factor near 1): it agrees with the target on some tokens, not all."""
    target = demo_model("llama")
    out = tmp_path_factory.mktemp("draft") / "perturbed"
    shutil.copytree(target, out)
    gen = torch.Generator().manual_seed(123)
    for f in out.glob("*.safetensors"):
        tensors = {name: t * (1 + 0.3 * torch.randn(t.shape, generator=gen)) for name, t in load_file(f).items()}
        save_file({k: v.contiguous() for k, v in tensors.items()}, f, metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def speculative_configs(demo_model, other_draft) -> dict[str, SpeculativeConfig]:
    target = demo_model("llama")
    return {
        "ngram": SpeculativeConfig("ngram", K, ngram_min=1, ngram_max=3),
        "draft-self": SpeculativeConfig("draft", K, draft_model=target),
        "draft-other": SpeculativeConfig("draft", 3, draft_model=other_draft),
    }


@pytest.mark.parametrize("method", ["ngram", "draft-self", "draft-other"])
def test_greedy_output_is_unchanged_alone_and_batched(demo_model, speculative_configs, method):
    model = demo_model("llama")
    spec = speculative_configs[method]
    prompts = copy_heavy(random_prompts(12, 1000, (4, 60), seed=3))
    plain = build_engine(model).engine
    fast = build_engine(model, speculative=spec).engine
    want = token_ids(run_to_completion(plain, [(p, greedy(24)) for p in prompts]))
    assert token_ids(run_to_completion(fast, [(prompts[0], greedy(24))]))[0] == want[0]
    assert token_ids(run_to_completion(fast, [(p, greedy(24)) for p in prompts])) == want
    assert want[0] == hf_greedy(model, prompts[0], 24)
    stats = fast.stats().speculative
    assert stats.drafts > 0 and stats.draft_tokens > 0
    if method == "draft-self":  # the model agrees with itself: every proposal is kept
        assert stats.accepted_tokens == stats.draft_tokens
        assert stats.accepted_per_position[0] == stats.drafts
    if method == "ngram":
        assert stats.accepted_tokens > 0
    if method == "draft-other":  # a different model: some proposals kept, some refused
        assert 0 < stats.accepted_tokens < stats.draft_tokens


@pytest.mark.parametrize("method", ["ngram", "draft-self"])
def test_greedy_output_is_unchanged_under_preemption_and_with_a_cached_prefix(demo_model, speculative_configs,
                                                                               method):
    model = demo_model("llama")
    spec = speculative_configs[method]
    prompts = copy_heavy(random_prompts(10, 1000, (20, 40), seed=9))
    # 20 blocks of 16 tokens: too few for 10 sequences of ~100 tokens at once
    small_pool = str(20 * 2 * 2 * 16 * 4 * 16 * 4)
    plain = token_ids(run_to_completion(build_engine(model).engine, [(p, greedy(30)) for p in prompts]))
    fast = build_engine(model, kv=small_pool, speculative=spec, max_total_tokens=256).engine
    got = token_ids(run_to_completion(fast, [(p, greedy(30)) for p in prompts]))
    assert got == plain
    assert fast.stats().preemptions_total > 0
    # a second round finds the prompts' blocks in the prefix cache
    got = token_ids(run_to_completion(fast, [(p, greedy(30)) for p in prompts[:3]]))
    assert got == plain[:3]
    assert fast.stats().prefix_cache_hits > 0


def test_requests_may_turn_it_off_and_constrained_rows_do_not_speculate(demo_model):
    model = demo_model("llama")
    fast = build_engine(model, speculative=SpeculativeConfig("draft", K, draft_model=model)).engine
    prompt = copy_heavy(random_prompts(1, 1000, (20, 20), seed=4))[0]
    off = make_sampling_params(max_new_tokens=16, ignore_eos=True, speculative=False)
    penalized = make_sampling_params(max_new_tokens=16, ignore_eos=True, repetition_penalty=1.3)
    out = token_ids(run_to_completion(fast, [(prompt, off), (prompt, penalized)]))
    assert fast.stats().speculative.drafts == 0
    plain = build_engine(model).engine
    assert out == token_ids(run_to_completion(plain, [(prompt, off), (prompt, penalized)]))


def test_speculation_pauses_while_disable_by_batch_size_sequences_run(demo_model):
    model = demo_model("llama")
    prompts = copy_heavy(random_prompts(3, 1000, (20, 20), seed=5))
    spec = SpeculativeConfig("draft", K, draft_model=model, disable_by_batch_size=3)
    plain = token_ids(run_to_completion(build_engine(model).engine, [(p, greedy(20)) for p in prompts]))
    # three sequences of one length run together from start to end: no step speculates
    fast = build_engine(model, speculative=spec).engine
    assert token_ids(run_to_completion(fast, [(p, greedy(20)) for p in prompts])) == plain
    assert fast.stats().speculative.drafts == 0
    # two run below the limit: they speculate (a self-draft: every proposal kept)
    assert token_ids(run_to_completion(fast, [(p, greedy(20)) for p in prompts[:2]])) == plain[:2]
    assert fast.stats().speculative.drafts > 0
    # a short third one: speculation resumes when it ends, and the draft catches up
    before = fast.stats().speculative.drafts
    mixed = token_ids(run_to_completion(fast, [(prompts[0], greedy(20)), (prompts[1], greedy(20)),
                                               (prompts[2], greedy(3))]))
    assert mixed[:2] == plain[:2] and mixed[2] == plain[2][:3]
    stats = fast.stats().speculative
    assert stats.drafts > before and stats.accepted_tokens == stats.draft_tokens


def test_disable_by_batch_size_of_one_is_refused():
    with pytest.raises(ValueError, match="--speculative-disable-by-batch-size must be 0 .* got 1"):
        SpeculativeConfig("ngram", K, disable_by_batch_size=1)


# ---- sampled output -------------------------------------------------------------------
def sampled(seed: int, n: int = 12, **kw):
    return make_sampling_params(max_new_tokens=n, do_sample=True, temperature=1.0, seed=seed, ignore_eos=True, **kw)


@pytest.mark.parametrize("method", ["ngram", "draft-other"])
def test_sampled_output_with_a_seed_is_reproducible(demo_model, speculative_configs, method):
    model = demo_model("llama")
    spec = speculative_configs[method]
    prompts = copy_heavy(random_prompts(6, 1000, (10, 30), seed=5))
    runs = []
    for _ in range(2):
        engine = build_engine(model, speculative=spec).engine
        runs.append(token_ids(run_to_completion(engine, [(p, sampled(100 + i)) for i, p in enumerate(prompts)])))
    assert runs[0] == runs[1]
    # one alone gives what it gave in the batch
    alone = build_engine(model, speculative=spec).engine
    assert token_ids(run_to_completion(alone, [(prompts[2], sampled(102))]))[0] == runs[0][2]


@pytest.mark.parametrize("method", ["draft-self", "draft-other"])
def test_sampled_tokens_follow_the_distribution_of_sampling_without_speculation(demo_model, speculative_configs,
                                                                                 method):
    """600 seeded requests of 4 tokens each way: the tokens at positions 2-4 (those a
    verification emits) have the same distribution with and without speculation."""
    model = demo_model("llama")
    spec = speculative_configs[method]
    prompt = random_prompts(1, 1000, (12, 12), seed=11)[0]
    requests_ = [(prompt, sampled(1000 + i, n=4, top_k=3)) for i in range(600)]
    plain = build_engine(model, max_num_seqs=128, kv="128MiB").engine
    fast = build_engine(model, max_num_seqs=128, kv="128MiB", speculative=spec).engine
    a = token_ids(run_to_completion(plain, requests_))
    b = token_ids(run_to_completion(fast, requests_))
    assert fast.stats().speculative.drafts > 0
    for position in (1, 2, 3):
        stat, df = chi_square_same(Counter(t[position] for t in a), Counter(t[position] for t in b))
        assert stat < chi_square_critical(max(df, 1)), (position, stat, df)
    pairs_a = Counter((t[1], t[2]) for t in a)
    pairs_b = Counter((t[1], t[2]) for t in b)
    stat, df = chi_square_same(pairs_a, pairs_b)
    assert stat < chi_square_critical(max(df, 1)), ("pairs", stat, df)


# ---- sharded groups ------------------------------------------------------------------
def gen_request(ids, n):
    return pb.GenerateRequest(request_id="s", input_ids=ids, sampling=pb.SamplingParameters(),
                              stopping=pb.StoppingCriteria(max_new_tokens=n, ignore_eos=True))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["tensor", "zero3"])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sharded_groups_speculate_with_identical_greedy_output(demo_model, other_draft, strategy, method):
    import threading

    model = demo_model("llama")
    prompts = copy_heavy(random_prompts(8, 1000, (10, 50), seed=21))
    flags = ["--speculative", method, "--num-speculative-tokens", "3", "--speculative-ngram-min", "1"]
    if method == "draft":
        flags += ["--speculative-draft-model", str(other_draft)]
    # a pool too small for all at once: preemption happens under speculation too
    kv_bytes = str(24 * (2 * 2 * 16 * 4 * 16 * 4 // (2 if strategy == "tensor" else 1)))
    group = start_group(model, strategy, 2, "--kv-cache-memory", kv_bytes, "--max-total-tokens", "256",
                        "--max-batch-tokens", "128", *flags)
    try:
        stub = group.leader.stub()
        results: dict[int, list[int]] = {}

        def run(i):
            results[i] = [t.id for t in stub.Generate(gen_request(prompts[i], 20), timeout=180)]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
        for i, prompt in enumerate(prompts):
            assert results[i] == hf_greedy(model, prompt, 20), f"request {i}"
    finally:
        group.stop()


# ---- metrics and refusals ----------------------------------------------------------------
def test_metrics_carry_vllms_speculative_names(demo_model):
    model = demo_model("llama")
    shard = start_shard(model, "--speculative", "draft", "--speculative-draft-model", str(model),
                        "--num-speculative-tokens", "3", metrics=True)
    try:
        prompt = random_prompts(1, 1000, (10, 10), seed=2)[0]
        tokens = [t.id for t in shard.stub().Generate(gen_request(prompt, 13), timeout=60)]
        assert len(tokens) == 13
        text = requests.get(f"http://127.0.0.1:{shard.metrics_port}/metrics", timeout=10).text
        values = {line.split(" ")[0]: float(line.split(" ")[-1]) for line in text.splitlines()
                  if line.startswith(("vllm:spec_decode", "kubeshard_engine_spec"))}
        drafts = values['vllm:spec_decode_num_drafts_total{model_name="' + model.name + '"}']
        accepted = values['vllm:spec_decode_num_accepted_tokens_total{model_name="' + model.name + '"}']
        proposed = values['vllm:spec_decode_num_draft_tokens_total{model_name="' + model.name + '"}']
        # 12 tokens after the first come out of 3 full verifications of 3 + 1
        assert (drafts, proposed, accepted) == (3, 9, 9)
        assert values['kubeshard_engine_spec_decode_mean_acceptance_length{model_name="' + model.name + '"}'] == 4.0
    finally:
        shard.stop()


@pytest.mark.parametrize("fields, named", [
    (dict(method="draft"), "--speculative-draft-model"),
    (dict(method="ngram", num_tokens=0), "--num-speculative-tokens"),
    (dict(method="ngram", ngram_min=3, ngram_max=2), "--speculative-ngram-min"),
    (dict(method="ngram", draft_model="x"), "--speculative-draft-model"),
    (dict(method="sometimes"), "--speculative must be one of"),
])
def test_bad_speculative_settings_name_the_flag(fields, named):
    with pytest.raises(ValueError, match=named):
        SpeculativeConfig(**fields)


def test_a_draft_of_another_tokenizer_is_refused_at_start(demo_model):
    model = demo_model("llama")
    config = EngineConfig(model_dir=model, model_id="m",
                          speculative=SpeculativeConfig("draft", K, draft_model=demo_model("llama", size="small")))
    with pytest.raises(ValueError, match="--speculative-draft-model .*vocabulary"):
        build_served_model(config)
