"""The default model (SmolLM2-135M-Instruct, a Q4_1 GGUF) quantized three ways against its
float32 conversion: greedy agreement measured and recorded (the first token where each
answer departs from float32's is written to tests/artifacts/quantization-agreement.json
and printed, not hidden), the first logits within stated tolerances, and the known
answers still right.

- ``gguf`` keeps the file's own Q4_1 / Q8_0 bytes: the weights are float32's exactly, and
  what differs is the int8 quantization of the activations inside the kernels;
- ``int8`` re-quantizes those weights per channel, ``int4`` per group of 32 (which for
  this file's Q4_1 projections gives its very bytes; the LM head becomes int8).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kubeshard_shard.engine.request import make_sampling_params

from tests.support.default_model import KNOWN, MORE, chat_ids, folder
from tests.support.engine import build_engine, prefill_logits, relative_rms, run_to_completion

pytestmark = pytest.mark.slow

ARTIFACT = Path(__file__).resolve().parents[1] / "artifacts" / "quantization-agreement.json"
# relative RMS error of the first answer token's logits, averaged over the questions
LOGIT_TOLERANCE = {"gguf": 0.05, "int8": 0.10, "int4": 0.10}


def _answers(served, prompts):
    outs = run_to_completion(served.engine, [(p, make_sampling_params(max_new_tokens=24)) for p in prompts])
    return [[o.token_id for o in out] for out in outs], ["".join(o.text for o in out) for out in outs]


@pytest.fixture(scope="module")
def reference():
    served = build_engine(folder(), kv="128MiB", max_total_tokens=512)
    prompts = [chat_ids(q) for q in list(KNOWN) + MORE]
    ids, texts = _answers(served, prompts)
    logits = [prefill_logits(served, p) for p in prompts]
    return prompts, ids, texts, logits


@pytest.mark.parametrize("method", ["gguf", "int8", "int4"])
def test_default_model_agreement(reference, method):
    prompts, want_ids, want_texts, want_logits = reference
    served = build_engine(folder(), kv="128MiB", max_total_tokens=512, quantize=method)
    ids, texts = _answers(served, prompts)
    questions = list(KNOWN) + MORE
    rows = []
    for q, a, b, ta, tb in zip(questions, want_ids, ids, want_texts, texts):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is None and len(a) != len(b):
            first = min(len(a), len(b))
        rows.append({"question": q, "first_differing_token": first, "float32": ta, method: tb})
    errors = [relative_rms(a, prefill_logits(served, p)) for p, a in zip(prompts, want_logits)]
    record = json.loads(ARTIFACT.read_text()) if ARTIFACT.is_file() else {}
    record[method] = {"parameter_bytes": served.rank_parameter_bytes[0],
                      "identical_answers": sum(r["first_differing_token"] is None for r in rows),
                      "answers": len(rows), "first_logits_relative_rms_error": errors, "rows": rows}
    ARTIFACT.parent.mkdir(exist_ok=True)
    ARTIFACT.write_text(json.dumps(record, indent=2))
    for r in rows:
        print(f"{method}: {r['question']!r}: first differing token {r['first_differing_token']}")
    assert sum(errors) / len(errors) <= LOGIT_TOLERANCE[method], errors
    for (question, answer), text in zip(KNOWN.items(), texts):
        assert answer in text, f"{method}: {question} -> {text!r}"
    # the known answers' first token (what the question asks for) agrees
    assert all(a[:1] == b[:1] for a, b in zip(want_ids[:len(KNOWN)], ids))
