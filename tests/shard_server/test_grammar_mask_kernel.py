"""A step's grammar masks applied by the CPU kernel (``csrc/grammar_mask.cpp``): the same
logits as xgrammar's own kernel on every width (whole words, a vocabulary past the mask,
a mask past the vocabulary, tails of every length), on the rows listed only, in this
CPU's build and the portable ones; bad arguments named; and an engine's constrained
requests take the same tokens through it as through xgrammar's."""

from __future__ import annotations

import json

import pytest
import torch
import xgrammar as xgr

from kubeshard_shard.engine.grammar import apply_masks
from kubeshard_shard.engine.request import make_sampling_params
from kubeshard_shard.engine.sequence import GrammarSpec
from tests.support.engine import build_engine, random_prompts, run_to_completion

# (rows, vocabulary, bitmask words): the models' vocabularies, a vocabulary longer than
# its mask and one shorter, and tails of 1-31 tokens
SHAPES = [(16, 8192, 256), (3, 49152, 1536), (2, 49155, 1537), (4, 1000, 30), (5, 70, 4), (3, 33, 2),
          (2, 31, 1), (1, 1, 1)]


def masks(rows: int, words: int, seed: int) -> torch.Tensor:
    """Random words, and the patterns a grammar makes most: all allowed, none, one token."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.randint(-2 ** 31, 2 ** 31 - 1, (rows, words), dtype=torch.int32, generator=gen)
    mask[0] = -1
    if rows > 1:
        mask[1] = 0
        mask[1, 0] = 1 << 5
    return mask


def check(kernel, shape: tuple[int, int, int], seed: int = 0) -> None:
    rows, vocab, words = shape
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))
    mask = masks(rows, words, seed)
    for listed in (list(range(rows)), list(range(0, rows, 2)), [rows - 1], []):
        want, got = logits.clone(), logits.clone()
        xgr.apply_token_bitmask_inplace(want, mask, vocab_size=min(vocab, words * 32), indices=listed)
        kernel(got, mask, listed)
        assert torch.equal(got, want), (shape, listed)
        unlisted = [r for r in range(rows) if r not in listed]
        assert torch.equal(got[unlisted], logits[unlisted])


@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_masks_as_xgrammar_does(cpu_kernels, shape):
    check(cpu_kernels.apply_bitmask_, shape, seed=shape[1])


def test_kernel_of_the_portable_builds_masks_as_xgrammar_does(portable_kernels):
    for shape in SHAPES:
        check(portable_kernels.apply_bitmask_, shape, seed=shape[1])


def test_kernel_names_what_is_wrong(cpu_kernels):
    logits, mask = torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="row 2 is outside the logits"):
        cpu_kernels.apply_bitmask_(logits, mask, [0, 2])
    with pytest.raises(RuntimeError, match="row -1"):
        cpu_kernels.apply_bitmask_(logits, mask, [-1])
    with pytest.raises(RuntimeError, match="apply_bitmask_: logits"):
        cpu_kernels.apply_bitmask_(logits.double(), mask, [0])
    with pytest.raises(RuntimeError, match="apply_bitmask_: bitmask"):
        cpu_kernels.apply_bitmask_(logits, mask.long(), [0])
    assert torch.equal(logits, torch.zeros(2, 64)), "a refused call wrote nothing"
    # the Python side takes xgrammar's path where the kernel does not serve
    half = torch.zeros(2, 64, dtype=torch.bfloat16)
    apply_masks(half, mask, [1], cpu_kernels)
    assert torch.isinf(half[1]).all() and not torch.isinf(half[0]).any()


class CountingKernels:
    """The real kernels' module, counting the calls of ``apply_bitmask_`` (to see the
    sampler take it)."""

    def __init__(self, module) -> None:
        self._module, self.mask_calls = module, 0

    def __getattr__(self, name):
        return getattr(self._module, name)

    def apply_bitmask_(self, *args):
        self.mask_calls += 1
        return self._module.apply_bitmask_(*args)


def test_constrained_requests_take_the_same_tokens_through_the_kernel(demo_model, cpu_kernels):
    served = build_engine(demo_model("llama"), max_total_tokens=512)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 999}},
              "required": ["name", "n"]}
    specs = [GrammarSpec("json_schema", json.dumps(schema)), GrammarSpec("regex", r"[a-z]{3,8}-\d{2}")]
    prompts = random_prompts(6, 1000, (6, 30), seed=3)
    batch = [(prompts[i], make_sampling_params(max_new_tokens=48, grammar=specs[i % 2], do_sample=i >= 2,
                                               seed=i, temperature=1.0)) for i in range(4)]
    batch += [(prompts[i], make_sampling_params(max_new_tokens=12, ignore_eos=True)) for i in (4, 5)]
    counting = CountingKernels(cpu_kernels)
    served.engine.sampler.kernels = counting
    through_kernel = run_to_completion(served.engine, batch)
    assert counting.mask_calls > 0
    served.engine.sampler.kernels = None  # xgrammar's mask and torch's argmax
    through_xgrammar = run_to_completion(served.engine, batch)
    assert [[o.token_id for o in r] for r in through_kernel] == [[o.token_id for o in r] for r in through_xgrammar]
