"""spec.runtime: what each engine's group looks like (pure builders on plain dicts), and
the specs a runtime cannot honour, refused with the field's name (the CRD's CEL rules
say the same at admission; e2e/operator/test_runtimes.py shows the API server refusing)."""

from __future__ import annotations

import pytest

from kubeshard_operator import builders as b
from kubeshard_operator import naming as n
from kubeshard_operator.spec import SpecError
from tests.operator.factories import CFG, make_spec

GGUF = "/cache/models/smollm2.gguf"


def pod(spec) -> dict:
    return b.build_statefulset(spec, CFG, 0)["spec"]["template"]["spec"]


def by_name(containers: list[dict]) -> dict[str, dict]:
    return {c["name"]: c for c in containers}


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_default_runtime_is_kubeshard_and_unchanged():
    spec = make_spec()
    assert spec.runtime.name == "kubeshard" and spec.pods_per_group == 2
    assert [c["name"] for c in pod(spec)["containers"]] == ["shard"]
    assert "--runtime" not in pod(spec)["containers"][0]["args"]


def test_llamacpp_group_is_one_pod_of_engine_and_engine_info():
    spec = make_spec(model={"source": GGUF, "name": "smollm2"}, sharding={"shards": 1},
                     runtime={"name": "llamacpp", "args": ["--n_batch", "256"]},
                     engine={"maxTotalTokens": 2048})
    sts = b.build_statefulset(spec, CFG, 0)
    assert sts["spec"]["replicas"] == 1
    containers = by_name(sts["spec"]["template"]["spec"]["containers"])
    engine, info = containers["engine"], containers["engine-info"]
    assert engine["image"] == CFG.llamacpp_image
    assert engine["command"][:3] == ["python3", "-m", "llama_cpp.server"]
    assert flag(engine["command"], "--model") == "/models/smollm2.gguf"
    assert flag(engine["command"], "--n_ctx") == "2048" and flag(engine["command"], "--port") == "8000"
    assert flag(engine["command"], "--interrupt_requests") == "False"
    assert engine["command"][-2:] == ["--n_batch", "256"]  # spec.runtime.args last
    assert engine["readinessProbe"]["httpGet"] == {"path": "/openapi.json", "port": 8000}
    assert engine["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    # engine-info answers the router on the gRPC port the leader Service already exposes
    assert info["image"] == CFG.shard_image and info["args"][0] == "engine-info"
    assert flag(info["args"], "--openai-port") == "8000" and flag(info["args"], "--port") == str(n.GRPC_PORT)
    assert flag(info["args"], "--engine-url") == "http://127.0.0.1:8000"
    assert flag(info["args"], "--max-total-tokens") == "2048"
    assert info["readinessProbe"]["grpc"] == {"port": n.GRPC_PORT}
    assert info["ports"][0]["name"] == "grpc"


def test_vllm_shards_inside_one_pod_with_all_the_groups_gpus():
    spec = make_spec(model={"source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"},
                     sharding={"shards": 2}, resources={"gpu": 1}, runtime={"name": "vllm", "port": 8080})
    sts = b.build_statefulset(spec, CFG, 0)
    assert sts["spec"]["replicas"] == 1
    template = sts["spec"]["template"]["spec"]
    engine = by_name(template["containers"])["engine"]
    assert engine["image"] == CFG.vllm_image
    assert engine["command"][:3] == ["vllm", "serve", "/models/model"]
    assert flag(engine["command"], "--tensor-parallel-size") == "2"
    assert flag(engine["command"], "--served-model-name") == "tiny"
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert engine["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8080}
    assert [c["name"] for c in template["initContainers"]] == ["download"]  # hf:// fetched first


def test_a_generic_openai_server_runs_its_own_entrypoint_with_the_specs_args():
    args = ["--model-path", "$(KUBESHARD_MODEL_DIR)", "--served-model-name", "$(KUBESHARD_MODEL_NAME)",
            "--port", "$(KUBESHARD_PORT)", "--tp", "$(KUBESHARD_SHARDS)"]
    spec = make_spec(model={"source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct", "name": "smollm2"},
                     sharding={"shards": 2}, resources={"gpu": 1},
                     runtime={"name": "openai", "image": "lmsysorg/sglang:v0.5.6", "args": args, "port": 30000},
                     engine={"maxConcurrentRequests": 64})
    assert spec.pods_per_group == 1
    sts = b.build_statefulset(spec, CFG, 0)
    assert sts["spec"]["replicas"] == 1
    containers = by_name(sts["spec"]["template"]["spec"]["containers"])
    engine, info = containers["engine"], containers["engine-info"]
    assert engine["image"] == "lmsysorg/sglang:v0.5.6"
    assert "command" not in engine and engine["args"] == args  # the image's entrypoint, the spec's args
    env = {v["name"]: v.get("value") for v in engine["env"]}
    assert (env["KUBESHARD_MODEL_DIR"], env["KUBESHARD_MODEL_NAME"]) == ("/models/model", "smollm2")
    assert (env["KUBESHARD_PORT"], env["KUBESHARD_SHARDS"]) == ("30000", "2")
    assert engine["readinessProbe"]["httpGet"] == {"path": "/health", "port": 30000}
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert flag(info["args"], "--runtime") == "openai" and flag(info["args"], "--openai-port") == "30000"
    assert flag(info["args"], "--max-concurrent-requests") == "64"
    # the variables named for args leave the other runtimes' pods unchanged
    vllm = make_spec(model={"source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"}, runtime={"name": "vllm"})
    vllm_env = by_name(pod(vllm)["containers"])["engine"]["env"]
    assert not any(v["name"].startswith("KUBESHARD_MODEL") for v in vllm_env)


def test_the_users_env_wins_over_the_variables_named_for_args():
    spec = make_spec(model={"source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"}, sharding={"shards": 1},
                     runtime={"name": "openai", "image": "ghcr.io/huggingface/text-generation-inference:3.3.6"},
                     pod={"env": [{"name": "KUBESHARD_PORT", "value": "80"}]})
    env = [v for v in by_name(pod(spec)["containers"])["engine"]["env"] if v["name"] == "KUBESHARD_PORT"]
    assert env == [{"name": "KUBESHARD_PORT", "value": "80"}]


def test_onnx_runs_in_the_shard_server():
    spec = make_spec(sharding={"shards": 1}, runtime={"name": "onnx"})
    containers = pod(spec)["containers"]
    assert [c["name"] for c in containers] == ["shard"]
    assert flag(containers[0]["args"], "--runtime") == "onnx"


def test_changing_the_runtime_rolls_the_groups():
    a = make_spec(model={"source": GGUF}, sharding={"shards": 1})
    c = make_spec(model={"source": GGUF}, sharding={"shards": 1}, runtime={"name": "llamacpp"})
    assert b.template_hash(a, CFG) != b.template_hash(c, CFG)


@pytest.mark.parametrize("overrides, message", [
    ({"runtime": {"name": "vllm"}, "sharding": {"strategy": "zero3"}}, "spec.sharding.strategy zero3 needs"),
    ({"runtime": {"name": "llamacpp"}, "model": {"source": GGUF}, "sharding": {"shards": 2}},
     "spec.sharding.shards must be 1"),
    ({"runtime": {"name": "llamacpp"}, "sharding": {"shards": 1}}, "llamacpp needs a .gguf file"),
    ({"runtime": {"name": "vllm"}, "model": {"source": GGUF}}, "vllm serves a Hugging Face folder"),
    ({"runtime": {"name": "onnx"}, "sharding": {"shards": 1}, "resources": {"gpu": 1}},
     "spec.resources.gpu must be 0"),
    ({"runtime": {"name": "kubeshard", "image": "x"}}, "spec.runtime.image and spec.runtime.args are for"),
    ({"runtime": {"name": "openai"}}, "spec.runtime.name openai needs spec.runtime.image"),
    ({"runtime": {"name": "openai", "image": "x"}, "sharding": {"strategy": "zero3"}},
     "spec.sharding.strategy zero3 needs"),
    ({"runtime": {"name": "tensorrt"}}, "spec.runtime.name 'tensorrt' is not one of"),
    ({"runtime": {"name": "vllm"}, "model": {"source": "/m", "adapters": [{"name": "a", "source": "/a"}]}},
     "spec.model.adapters are applied by the kubeshard runtime only, not vllm"),
    ({"runtime": {"name": "onnx"}, "sharding": {"shards": 1}, "model": {"source": "/m", "adapterRoot": "/srv/l"}},
     "spec.model.adapterRoot: adapters are loaded at run time by the kubeshard runtime only, not onnx"),
    ({"runtime": {"name": "vllm", "port": 0}}, "spec.runtime.port must be at least 1"),
])
def test_a_runtime_refuses_what_it_cannot_honour(overrides, message):
    with pytest.raises(SpecError, match=message):
        make_spec(**overrides)
