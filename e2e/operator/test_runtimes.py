"""spec.runtime on the real control plane: bad runtime specs refused at admission (the
CRD's CEL rules, with messages naming the field), and an InferenceService whose runtime
is llama.cpp's server becoming Ready and streaming through the router.

The llama.cpp test runs the operator's llama.cpp server image, which ``hack/images.sh``
compiles with the other images (the local node and kind load it). The model is the
default model's GGUF file, copied where the node's hostPath volumes see it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from e2e.operator.conftest import CRDS, apply, inference_service, isvc, kubectl_json, wait_phase
from e2e.operator.test_operator import stream_through_router
from kubeshard_shard.checkpoints import default_model_file
from kubeshard_shard.paths import cache_root

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("spec, message", [
    ({"runtime": {"name": "vllm"}, "sharding": {"shards": 2, "strategy": "zero3"}},
     "spec.sharding.strategy zero3 needs spec.runtime.name kubeshard"),
    ({"runtime": {"name": "llamacpp"}}, "spec.runtime.name llamacpp needs a .gguf file"),
    ({"runtime": {"name": "onnx"}, "sharding": {"shards": 2}},
     "spec.runtime.name llamacpp and onnx serve a replica from one process"),
    ({"runtime": {"name": "onnx"}, "resources": {"cpu": "1", "gpu": 1}}, "spec.resources.gpu must be 0"),
    ({"runtime": {"name": "kubeshard", "image": "x"}}, "spec.runtime.image and spec.runtime.args are for"),
    ({"runtime": {"name": "openai"}}, "spec.runtime.name openai needs spec.runtime.image"),
    ({"runtime": {"name": "tensorrt-llm"}},
     'supported values: "kubeshard", "onnx", "vllm", "llamacpp", "openai"'),
], ids=["zero3-on-vllm", "llamacpp-without-gguf", "onnx-sharded", "onnx-gpu", "image-on-kubeshard",
        "openai-without-image", "unknown-runtime"])
def test_bad_runtime_specs_are_refused_at_admission(cluster, namespace, spec, message, tmp_path):
    # the CRD alone (its schema and CEL rules) refuses them: no operator needed
    cluster.kubectl("apply", "--server-side", "-f", str(CRDS))
    body = inference_service("bad-runtime", namespace, tmp_path)
    body["spec"].update(spec)
    out = apply(cluster, body, check=False)
    assert out.returncode != 0
    assert message in out.stderr, out.stderr
    assert isvc(cluster, namespace, "bad-runtime") is None


def test_llamacpp_runtime_becomes_ready_and_streams_through_the_router(cluster, kubeshard, namespace):
    gguf = _on_the_node(default_model_file())
    apply(cluster, inference_service("llama", namespace, gguf, runtime={"name": "llamacpp"},
                                     resources={"cpu": "500m", "memory": "2Gi"},
                                     engine={"maxTotalTokens": 512}))
    try:
        obj = wait_phase(cluster, namespace, "llama", "Ready", 1, timeout=300)
        assert obj["spec"]["runtime"]["name"] == "llamacpp"
        pod = kubectl_json(cluster, "-n", namespace, "get", "pod", "llama-g0-0")
        assert [c["name"] for c in pod["spec"]["containers"]] == ["engine", "engine-info"]
        assert all(c["ready"] for c in pod["status"]["containerStatuses"])
        events = stream_through_router(cluster, namespace,
                                       f"{kubeshard.router_url}/models/llama/generate_stream")
        tokens = [e for e in events if e.get("token")]
        assert len(tokens) >= 1
        assert "Paris" in events[-1]["generated_text"]  # greedy SmolLM2 on "The capital of France is"
    finally:
        cluster.kubectl("-n", namespace, "delete", "inferenceservice", "llama", "--timeout=120s",
                        check=False, timeout=150)


def _on_the_node(model: Path) -> Path:
    """The model file in the demo checkpoints' folder, which the nodes' hostPath volumes
    reach at the same path (the local node is this machine; kind mounts the folder)."""
    dest = cache_root() / "demo-models" / "gguf" / model.name
    if not dest.is_file() or dest.stat().st_size != model.stat().st_size:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_suffix(".partial")
        shutil.copyfile(model, tmp)
        tmp.replace(dest)
    return dest
