"""spec.model.quantize, spec.engine.kvCacheDtype and spec.engine.speculative on the real
control plane: what the shard server would refuse at start is refused at admission by
the CRD's schema and CEL rules, with a message naming the field; a spec using them all
within bounds is accepted and stored with its defaults. The CRD alone decides: no
operator is needed."""

from __future__ import annotations

import json

import pytest
import yaml

from e2e.operator.conftest import CRDS, apply, inference_service, isvc

pytestmark = pytest.mark.e2e

GGUF = "/models/smollm2.Q8_0.gguf"


def spec_with(body: dict, spec: dict) -> dict:
    """Merges `spec` one level deep into the body's spec (model, engine, ... keep their
    other fields)."""
    for key, value in spec.items():
        base = body["spec"].get(key)
        body["spec"][key] = {**base, **value} if isinstance(base, dict) and isinstance(value, dict) else value
    return body


BAD = [
    ({"model": {"quantize": "gguf"}}, "spec.model.quantize gguf keeps a GGUF file's quantized weights"),
    ({"model": {"quantize": "int8", "dtype": "bfloat16"}},
     "spec.model.quantize int8, int4 and gguf compute in float32"),
    ({"model": {"quantize": "int4"}, "resources": {"cpu": "1", "gpu": 1}},
     "spec.model.quantize int8, int4 and gguf run CPU kernels"),
    ({"model": {"quantize": "int4"}, "sharding": {"strategy": "zero3", "shards": 2}},
     "spec.model.quantize is not available with spec.sharding.strategy zero3"),
    ({"model": {"quantize": "int4", "quantizeGroupSize": 128}}, "spec.model.quantizeGroupSize must be 32 or 64"),
    ({"engine": {"kvCacheDtype": "fp8"}}, 'supported values: "auto", "float32", "bfloat16", "float16", "int8"'),
    ({"engine": {"speculative": {"method": "ngram", "ngramMin": 6}}},
     "spec.engine.speculative.ngramMin must be at most spec.engine.speculative.ngramMax"),
    ({"engine": {"speculative": {"method": "ngram", "numTokens": 17}}},
     "spec.engine.speculative.numTokens must be between 1 and 16"),
    ({"engine": {"speculative": {"method": "ngram", "draftModel": "/drafts/tiny"}}},
     "spec.engine.speculative.draftModel is only used with spec.engine.speculative.method draft"),
    ({"engine": {"speculative": {"method": "draft"}}},
     "spec.engine.speculative.method draft without draftModel drafts with the model's own checkpoint"),
    ({"engine": {"speculative": {"method": "draft", "draftModel": "hf://org/draft"}}},
     "spec.engine.speculative.draftModel must be pvc://CLAIM/PATH"),
    ({"engine": {"speculative": {"method": "draft", "draftModel": "/drafts/tiny", "draftQuantize": "int4"}},
      "resources": {"cpu": "1", "gpu": 1}}, "spec.engine.speculative.draftQuantize int8 and int4 run CPU kernels"),
    ({"runtime": {"name": "vllm"}, "model": {"quantize": "int8"}},
     "spec.model.quantize is an option of kubeshard's own engine"),
    ({"runtime": {"name": "onnx"}, "engine": {"speculative": {"method": "ngram"}}},
     "spec.engine.speculative is an option of kubeshard's own engine"),
    ({"runtime": {"name": "vllm"}, "engine": {"kvCacheDtype": "int8"}},
     "spec.engine.kvCacheDtype is an option of kubeshard's own engine"),
]
IDS = ["gguf-without-gguf-file", "quantize-bfloat16", "quantize-gpu", "quantize-zero3", "group-size-128",
       "kv-fp8", "ngram-min-over-max", "num-tokens-17", "draft-model-without-draft", "self-draft-unquantized",
       "draft-from-hf", "draft-quantize-gpu", "quantize-on-vllm", "speculative-on-onnx", "kv-dtype-on-vllm"]


@pytest.mark.parametrize("spec, message", BAD, ids=IDS)
def test_bad_speed_options_are_refused_at_admission(cluster, namespace, spec, message, tmp_path):
    cluster.kubectl("apply", "--server-side", "-f", str(CRDS))
    body = spec_with(inference_service("bad-speed", namespace, tmp_path), spec)
    out = apply(cluster, body, check=False)
    assert out.returncode != 0
    assert message in " ".join(out.stderr.split()), out.stderr
    assert isvc(cluster, namespace, "bad-speed") is None


@pytest.mark.parametrize("spec", [
    {"model": {"quantize": "int4", "quantizeGroupSize": 64},
     "engine": {"kvCacheDtype": "int8", "speculative": {"method": "ngram", "numTokens": 8, "ngramMax": 6}}},
    {"model": {"source": GGUF, "quantize": "gguf"},
     "engine": {"speculative": {"method": "draft", "draftModel": "pvc://drafts/smollm2-135m",
                                "draftQuantize": "int8"}}},
    {"model": {"quantize": "int8"}, "sharding": {"strategy": "zero3", "shards": 1},
     "engine": {"speculative": {"method": "draft", "draftQuantize": "int4"}}},
], ids=["int4-int8kv-ngram", "gguf-pvc-draft", "self-draft-zero3-of-one"])
def test_speed_options_within_bounds_are_accepted_with_defaults(cluster, namespace, spec, tmp_path):
    cluster.kubectl("apply", "--server-side", "-f", str(CRDS))
    body = spec_with(inference_service("fast", namespace, tmp_path), spec)
    out = cluster.kubectl("apply", "--dry-run=server", "-o", "json", "-f", "-",
                          input=yaml.safe_dump(body), check=False)
    assert out.returncode == 0, out.stderr
    stored = json.loads(out.stdout)["spec"]
    speculative = stored["engine"]["speculative"]
    assert speculative["method"] == spec["engine"]["speculative"]["method"]
    assert speculative["numTokens"] == spec["engine"]["speculative"].get("numTokens", 4)
    assert (speculative["ngramMin"], speculative["draftQuantize"]) == (
        2, spec["engine"]["speculative"].get("draftQuantize", "none"))
    assert stored["model"]["quantize"] == spec["model"]["quantize"]
    assert stored["engine"]["kvCacheDtype"] == spec["engine"].get("kvCacheDtype", "auto")
