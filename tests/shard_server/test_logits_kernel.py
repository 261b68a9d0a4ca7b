"""Each row's argmax and log-sum-exp in one kernel call (``csrc/logits.cpp``), against
torch's on the vocabulary sizes of the models and on the edges of its loops and of
torch's semantics (ties, NaN, infinities); and the sampler's, the speculative
verification's and the prompt's log-probabilities through it equal a log_softmax in
double."""

from __future__ import annotations

import pytest
import torch

from kubeshard_shard.engine.rejection import verify
from kubeshard_shard.engine.request import make_sampling_params
from kubeshard_shard.engine.sampler import Sampler, best_and_lse, token_logprobs
from kubeshard_shard.engine.sequence import Sequence

NAN, INF = float("nan"), float("inf")


def check(kernel, x: torch.Tensor) -> None:
    best, lse = kernel(x)
    assert best.dtype == torch.long and lse.dtype == torch.float64
    assert best.tolist() == x.argmax(dim=-1).tolist()
    want = torch.logsumexp(x.double(), dim=-1)
    torch.testing.assert_close(lse, want, rtol=0, atol=1e-6, equal_nan=True)


def edge_rows() -> torch.Tensor:
    rows = [
        [1.0, 3.0, 3.0, 2.0] + [0.0] * 21,       # a tie: the first index, as torch's
        [-INF] * 25,                             # nothing allowed: argmax 0, lse -inf
        [1.0, NAN, 5.0, NAN] + [0.0] * 21,       # a NaN wins, the first one; lse NaN
        [0.0] * 17 + [NAN] + [0.0] * 7,          # a NaN past the vector part
        [1.0, INF, 2.0] + [0.0] * 22,            # +inf: lse +inf
        [-INF] * 24 + [-3.0],                    # the only allowed value in the tail
        [-INF] * 9 + [2.0] + [-INF] * 15,        # a grammar mask leaving one token
    ]
    return torch.tensor(rows)


@pytest.mark.parametrize("shape", [(1, 49152), (7, 49152), (64, 49152), (3, 32000), (2, 17), (5, 8), (1, 1)])
def test_kernel_matches_torch(cpu_kernels, shape):
    gen = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    check(cpu_kernels.argmax_logsumexp, torch.randn(*shape, generator=gen) * 6)


def test_kernel_keeps_torchs_semantics_at_the_edges(cpu_kernels):
    check(cpu_kernels.argmax_logsumexp, edge_rows())


def test_kernel_of_the_portable_builds_matches_torch(portable_kernels):
    check(portable_kernels.argmax_logsumexp, torch.randn(3, 49152, generator=torch.Generator().manual_seed(1)) * 6)
    check(portable_kernels.argmax_logsumexp, edge_rows())


def test_kernel_refuses_what_it_does_not_serve(cpu_kernels):
    with pytest.raises(RuntimeError, match="2-d float32"):
        cpu_kernels.argmax_logsumexp(torch.zeros(4, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="empty"):
        cpu_kernels.argmax_logsumexp(torch.zeros(2, 0))
    # the Python side falls back to torch where the kernel does not serve
    best, lse = best_and_lse(torch.zeros(2, 3, dtype=torch.float64), cpu_kernels)
    assert best.tolist() == [0, 0] and lse.dtype == torch.float64


def seq_of(**params) -> Sequence:
    return Sequence("x", [1], make_sampling_params(max_new_tokens=4, **params))


def test_sampler_logprobs_and_alternatives_through_the_kernel_equal_log_softmax(cpu_kernels):
    logits = torch.randn(3, 49152, generator=torch.Generator().manual_seed(5)) * 4
    want = torch.log_softmax(logits.double(), dim=-1)  # torch's in float32 is 6e-6 off here
    seqs = [seq_of(top_n_tokens=3), seq_of(), seq_of(do_sample=True, seed=3, top_n_tokens=2)]
    with_kernel = Sampler(kernels=cpu_kernels)(logits.clone(), seqs)
    seqs = [seq_of(top_n_tokens=3), seq_of(), seq_of(do_sample=True, seed=3, top_n_tokens=2)]
    without = Sampler()(logits.clone(), seqs)
    for i, (a, b) in enumerate(zip(with_kernel, without)):
        assert a.token_id == b.token_id
        assert a.logprob == pytest.approx(want[i, a.token_id].item(), abs=2e-7)
        assert a.logprob == pytest.approx(b.logprob, abs=2e-5)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        for (t, lp) in a.top:
            assert lp == pytest.approx(want[i, t].item(), abs=2e-7)
    assert with_kernel[0].token_id == int(logits[0].argmax())


def test_verification_through_the_kernel_keeps_the_same_tokens_and_logprobs(cpu_kernels):
    logits = torch.randn(5, 49152, generator=torch.Generator().manual_seed(8)) * 4
    best = logits.argmax(dim=-1).tolist()
    want = torch.log_softmax(logits.double(), dim=-1)
    seq = seq_of(top_n_tokens=2)
    seq.spec_tokens = best[:2] + [(best[2] + 1) % 49152, 7]  # two kept, the third refused
    got = verify(logits.clone(), seq, cpu_kernels)
    assert [t.token_id for t in got] == best[:3]
    for i, t in enumerate(got):
        assert t.logprob == pytest.approx(want[i, t.token_id].item(), abs=2e-7)
        assert [a for a, _ in t.top] == torch.topk(logits[i], 2).indices.tolist()
    assert [t.token_id for t in verify(logits.clone(), seq, None)] == best[:3]


def test_prompt_logprobs_through_the_kernel_equal_log_softmax(cpu_kernels):
    logits = torch.randn(6, 49152, generator=torch.Generator().manual_seed(9)) * 4
    targets = [3, 49151, 0, 777, 12345, int(logits[5].argmax())]
    want = torch.log_softmax(logits.double(), dim=-1)
    values, top = token_logprobs(logits, targets, 3, cpu_kernels)
    for i, t in enumerate(targets):
        assert values[i] == pytest.approx(want[i, t].item(), abs=2e-7)
    assert [[t for t, _ in row] for row in top] == torch.topk(logits, 3).indices.tolist()
    for i, row in enumerate(top):
        for t, lp in row:
            assert lp == pytest.approx(want[i, t].item(), abs=2e-7)
    assert values[5] == top[5][0][1]  # the most likely token: one value, however it is asked for
    plain, plain_top = token_logprobs(logits, targets, 3, None)  # torch's ops, float32
    assert plain == pytest.approx(values, abs=2e-5)
    assert [[t for t, _ in row] for row in plain_top] == [[t for t, _ in row] for row in top]
    assert token_logprobs(logits, targets, 0, cpu_kernels)[1] == []
