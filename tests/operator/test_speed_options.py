"""spec.model.quantize, spec.engine.kvCacheDtype and spec.engine.speculative: parsed into
typed fields, refused with the field's name where the shard server would refuse them at
start (the CRD's CEL rules say the same at admission), passed to `serve-shard` only when
set, and a draft model mounted read-only like an adapter."""

from __future__ import annotations

import pytest

from kubeshard_operator import builders as b
from kubeshard_operator.spec import ModelSource, Speculative, SpecError
from tests.operator.factories import CFG, make_spec

GGUF = "/cache/models/smollm2.Q8_0.gguf"
SPEED_FLAGS = ("--quantize", "--quantize-group-size", "--kv-cache-dtype", "--speculative",
               "--num-speculative-tokens", "--speculative-ngram-min", "--speculative-ngram-max",
               "--speculative-draft-model", "--speculative-draft-quantize", "--speculative-disable-by-batch-size")


def shard(spec) -> dict:
    return b.build_statefulset(spec, CFG, 0)["spec"]["template"]["spec"]


def args(spec) -> list[str]:
    return shard(spec)["containers"][0]["args"]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def speculative(**fields) -> dict:
    return {"speculative": fields}


def test_unset_options_are_the_server_defaults_and_leave_the_pod_unchanged():
    spec = make_spec()
    assert (spec.model.quantize, spec.model.quantize_group_size) == ("none", 32)
    assert spec.engine.kv_cache_dtype == "auto" and spec.engine.speculative == Speculative()
    assert not spec.engine.speculative.enabled
    assert not set(SPEED_FLAGS) & set(args(spec))
    # written out at their defaults (as the API server's defaulting does), still no flag
    # and the same template hash: existing groups do not roll
    explicit = make_spec(model={"source": "/cache/demo-models/llama-tiny", "quantize": "none",
                                "quantizeGroupSize": 32},
                         engine={"kvCacheDtype": "auto", "speculative": {"method": "none", "numTokens": 4}})
    assert args(explicit) == args(spec)
    assert b.template_hash(explicit, CFG) == b.template_hash(spec, CFG)
    assert {v["name"] for v in shard(spec)["volumes"]} == {"dshm", "tmp", "model"}


def test_quantization_and_the_kv_cache_dtype_reach_the_shard_server():
    spec = make_spec(model={"source": "/m", "quantize": "int4", "quantizeGroupSize": 64},
                     engine={"kvCacheDtype": "int8"})
    argv = args(spec)
    assert (flag(argv, "--quantize"), flag(argv, "--quantize-group-size")) == ("int4", "64")
    assert flag(argv, "--kv-cache-dtype") == "int8"
    assert b.template_hash(spec, CFG) != b.template_hash(make_spec(model={"source": "/m"}), CFG)


def test_gguf_quantize_keeps_a_gguf_files_weights():
    spec = make_spec(model={"source": GGUF, "quantize": "gguf"})
    argv = args(spec)
    assert flag(argv, "--quantize") == "gguf" and "--quantize-group-size" not in argv
    assert flag(argv, "--model") == "/models/smollm2.Q8_0.gguf"
    # a zero3 "group" of one shard is a single process: the server packs its weights
    assert make_spec(model={"source": "/m", "quantize": "int8"},
                     sharding={"strategy": "zero3", "shards": 1}).model.quantize == "int8"


def test_ngram_speculation_passes_its_window():
    spec = make_spec(engine=speculative(method="ngram", numTokens=6, ngramMin=1, ngramMax=8))
    assert spec.engine.speculative == Speculative(method="ngram", num_tokens=6, ngram_min=1, ngram_max=8)
    argv = args(spec)
    assert (flag(argv, "--speculative"), flag(argv, "--num-speculative-tokens")) == ("ngram", "6")
    assert (flag(argv, "--speculative-ngram-min"), flag(argv, "--speculative-ngram-max")) == ("1", "8")
    assert "--speculative-draft-model" not in argv
    assert "--speculative-disable-by-batch-size" not in argv  # the server's default: at any batch size
    paused = make_spec(engine=speculative(method="ngram", disableByBatchSize=4))
    assert paused.engine.speculative.disable_by_batch_size == 4
    assert flag(args(paused), "--speculative-disable-by-batch-size") == "4"
    # zero3 groups speculate too (only quantization is refused there)
    assert make_spec(sharding={"strategy": "zero3", "shards": 2},
                     engine=speculative(method="ngram")).engine.speculative.enabled


@pytest.mark.parametrize("source, volume, mount, path", [
    ("pvc://drafts/smollm2-135m", {"persistentVolumeClaim": {"claimName": "drafts", "readOnly": True}},
     {"mountPath": "/draft", "readOnly": True, "subPath": "smollm2-135m"}, "/draft"),
    ("pvc://drafts", {"persistentVolumeClaim": {"claimName": "drafts", "readOnly": True}},
     {"mountPath": "/draft", "readOnly": True}, "/draft"),
    ("pvc://drafts/gguf/small.Q4_0.gguf", {"persistentVolumeClaim": {"claimName": "drafts", "readOnly": True}},
     {"mountPath": "/draft/small.Q4_0.gguf", "readOnly": True, "subPath": "gguf/small.Q4_0.gguf"},
     "/draft/small.Q4_0.gguf"),
    ("/srv/drafts/tiny", {"hostPath": {"path": "/srv/drafts/tiny", "type": "Directory"}},
     {"mountPath": "/draft", "readOnly": True}, "/draft"),
    ("file:///srv/drafts/tiny.gguf", {"hostPath": {"path": "/srv/drafts/tiny.gguf", "type": "File"}},
     {"mountPath": "/draft/tiny.gguf", "readOnly": True}, "/draft/tiny.gguf"),
])
def test_a_draft_model_is_mounted_read_only_and_served_from_there(source, volume, mount, path):
    spec = make_spec(engine=speculative(method="draft", draftModel=source, draftQuantize="int8"))
    pod = shard(spec)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert volumes["draft"] == {"name": "draft", **volume}
    assert mounts["draft"] == {"name": "draft", **mount}
    argv = args(spec)
    assert flag(argv, "--speculative") == "draft" and flag(argv, "--num-speculative-tokens") == "4"
    assert flag(argv, "--speculative-draft-model") == path
    assert flag(argv, "--speculative-draft-quantize") == "int8"
    assert "--speculative-ngram-min" not in argv


def test_without_a_draft_model_the_model_drafts_for_itself_quantized():
    for source, model_path in [("hf://HuggingFaceTB/SmolLM2-360M-Instruct", "/models/model"),
                               ("pvc://models/smollm2", "/models/pvc/smollm2"), (GGUF, "/models/smollm2.Q8_0.gguf")]:
        spec = make_spec(model={"source": source}, engine=speculative(method="draft", draftQuantize="int4"))
        argv = args(spec)
        assert flag(argv, "--speculative-draft-model") == flag(argv, "--model") == model_path
        assert flag(argv, "--speculative-draft-quantize") == "int4"
        assert "draft" not in {v["name"] for v in shard(spec)["volumes"]}  # the model's own mount serves


def test_the_draft_source_parses_like_an_adapters():
    spec = make_spec(engine=speculative(method="draft", draftModel="pvc://drafts/a/b"))
    assert spec.engine.speculative.draft_model == ModelSource(kind="pvc", location="drafts", path="a/b")


@pytest.mark.parametrize("overrides, message", [
    # the model's quantization
    ({"model": {"source": "/m", "quantize": "int2"}}, "spec.model.quantize 'int2' is not one of"),
    ({"model": {"source": "/m", "quantize": "int4", "quantizeGroupSize": 128}},
     "spec.model.quantizeGroupSize must be 32 or 64"),
    ({"model": {"source": "/m", "quantize": "gguf"}}, "spec.model.quantize gguf .* spec.model.source must be a .gguf"),
    ({"model": {"source": "/m", "quantize": "int8", "dtype": "bfloat16"}},
     "spec.model.quantize int8 computes in float32: spec.model.dtype must be auto or float32"),
    ({"model": {"source": "/m", "quantize": "int8"}, "resources": {"gpu": 1}},
     "spec.model.quantize int8 runs CPU kernels: spec.resources.gpu must be 0"),
    ({"model": {"source": "/m", "quantize": "int4"}, "sharding": {"strategy": "zero3", "shards": 2}},
     "spec.model.quantize int4 is not available with spec.sharding.strategy zero3: its flat partitions"),
    # the KV cache
    ({"engine": {"kvCacheDtype": "fp8"}}, "spec.engine.kvCacheDtype 'fp8' is not one of"),
    # speculative decoding
    ({"engine": speculative(method="eagle")}, "spec.engine.speculative.method 'eagle' is not one of"),
    ({"engine": speculative(method="ngram", numTokens=0)}, "spec.engine.speculative.numTokens must be at least 1"),
    ({"engine": speculative(method="ngram", numTokens=17)}, "spec.engine.speculative.numTokens must be at most 16"),
    ({"engine": speculative(method="ngram", ngramMin=5, ngramMax=3)},
     r"spec.engine.speculative.ngramMin \(5\) must be at most spec.engine.speculative.ngramMax \(3"),
    ({"engine": speculative(method="ngram", ngramMin=5)},
     r"spec.engine.speculative.ngramMin \(5\) must be at most .*ngramMax \(4; default 4\)"),
    ({"engine": speculative(method="ngram", ngramMax=65)}, "spec.engine.speculative.ngramMax must be at most 64"),
    ({"engine": speculative(method="ngram", disableByBatchSize=1)},
     "spec.engine.speculative.disableByBatchSize must be 0 .* not 1"),
    ({"engine": speculative(method="ngram", disableByBatchSize=-2)},
     "spec.engine.speculative.disableByBatchSize must be at least 0"),
    ({"engine": speculative(method="ngram", draftModel="/d")},
     "spec.engine.speculative.draftModel is only used with spec.engine.speculative.method draft"),
    ({"engine": speculative(method="draft")},
     "spec.engine.speculative.method draft without draftModel .* set spec.engine.speculative.draftQuantize"),
    ({"engine": speculative(method="draft", draftModel="hf://org/draft")},
     "spec.engine.speculative.draftModel: hf:// draft models are not downloaded"),
    ({"engine": speculative(method="draft", draftModel="drafts/tiny")},
     "spec.engine.speculative.draftModel: 'drafts/tiny' must be"),
    ({"engine": speculative(method="draft", draftModel="/d", draftQuantize="gguf")},
     "spec.engine.speculative.draftQuantize 'gguf' is not one of"),
    ({"engine": speculative(method="draft", draftModel="/d", draftQuantize="int4"), "resources": {"gpu": 1}},
     "spec.engine.speculative.draftQuantize int4 runs CPU kernels: spec.resources.gpu must be 0"),
    ({"engine": speculative(method="draft", draftQuantize="int8"), "model": {"source": "/m", "dtype": "float16"}},
     "spec.engine.speculative.draftQuantize int8 computes in float32: spec.model.dtype must be auto or float32"),
    # kubeshard's engine only
    ({"runtime": {"name": "vllm"}, "model": {"source": "hf://org/m", "quantize": "int8"}},
     "spec.model.quantize int8 is an option of kubeshard's own engine .* the vllm runtime would ignore it"),
    ({"runtime": {"name": "llamacpp"}, "model": {"source": GGUF, "quantize": "gguf"}, "sharding": {"shards": 1}},
     "spec.model.quantize gguf is an option of kubeshard's own engine"),
    ({"runtime": {"name": "onnx"}, "sharding": {"shards": 1}, "engine": speculative(method="ngram")},
     "spec.engine.speculative.method ngram is an option of kubeshard's own engine .* the onnx runtime"),
    ({"runtime": {"name": "openai", "image": "x"}, "engine": {"kvCacheDtype": "int8"}},
     "spec.engine.kvCacheDtype int8 is an option of kubeshard's own engine"),
])
def test_what_the_shard_server_would_refuse_is_refused_naming_the_field(overrides, message):
    with pytest.raises(SpecError, match=message):
        make_spec(**overrides)


def test_a_quantized_draft_on_a_gpu_is_fine_when_speculation_is_off():
    """draftQuantize alone does nothing (the server reads it only for method draft)."""
    spec = make_spec(resources={"gpu": 1}, engine=speculative(draftQuantize="int8"))
    assert not set(SPEED_FLAGS) & set(args(spec))



@pytest.mark.parametrize("overrides, draft", [
    ({"model": {"source": "/m", "quantize": "int4", "quantizeGroupSize": 64}, "engine": {"kvCacheDtype": "int8"}},
     None),
    ({"engine": speculative(method="ngram", numTokens=6, ngramMin=1, ngramMax=8, disableByBatchSize=8)}, None),
    ({"engine": speculative(method="draft", draftModel="pvc://drafts/tiny.gguf", draftQuantize="int4")},
     "/draft/tiny.gguf"),
    ({"model": {"source": GGUF, "quantize": "gguf"}, "engine": speculative(method="draft", draftQuantize="int8")},
     "/models/smollm2.Q8_0.gguf"),
    ({}, None),
])
def test_the_shard_server_reads_the_pods_command_line_as_the_spec_says(overrides, draft):
    """The pod's args parsed by the real `kubeshard serve-shard` parser into the real
    EngineConfig (which validates them as at start) carry the spec's choices."""
    from kubeshard_shard.cli import build_parser
    from kubeshard_shard.config import EngineConfig

    spec = make_spec(**overrides)
    config = EngineConfig.from_args(build_parser().parse_args(args(spec)))
    m, s = spec.model, spec.engine.speculative
    assert (config.quantize, config.quantize_group_size) == (m.quantize, m.quantize_group_size)
    assert config.kv_cache_dtype == spec.engine.kv_cache_dtype
    got = config.speculative
    assert (got.method, got.num_tokens, got.draft_quantize) == (s.method, s.num_tokens, s.draft_quantize)
    assert (got.ngram_min, got.ngram_max) == (s.ngram_min, s.ngram_max)
    assert got.disable_by_batch_size == s.disable_by_batch_size
    assert (str(got.draft_model) if got.draft_model else None) == draft
