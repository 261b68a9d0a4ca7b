"""LoRA adapters loaded at run time on the real kubelet: the InferenceService names an
adapter root (spec.model.adapterRoot, here a host folder), the operator mounts it at
/lora-root in the shard pod, and the chart's router (router.runtimeLora) loads an adapter
from there through vLLM's admin route; requests then name the adapter."""

from __future__ import annotations

import shutil
import uuid

import httpx
import pytest

from e2e.operator.conftest import apply, inference_service, wait_phase
from tests.support.lora import make_adapter

pytestmark = pytest.mark.e2e

PROMPT = "The quick brown fox"


def complete(url: str, model: str) -> httpx.Response:
    return httpx.post(url + "/completions", timeout=120, json={
        "model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True})


@pytest.fixture
def adapter_root(demo_model_dir):
    """A host folder of adapter folders beside the demo model's, readable by the shard's
    user (uid 10001; pytest's own folders are private to root), but for one file."""
    root = demo_model_dir.parent / f"e2e-loras-{uuid.uuid4().hex[:8]}"
    make_adapter(demo_model_dir, root / "alpha", seed=1, r=4, targets=["q_proj", "v_proj"], alpha=8)
    make_adapter(demo_model_dir, root / "private", seed=2, r=4, targets=["o_proj"], alpha=8)
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    (root / "private" / "adapter_model.safetensors").chmod(0o600)  # as safetensors saves it
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_an_adapter_loaded_at_run_time_through_the_router(cluster, kubeshard, namespace, demo_model_dir,
                                                          adapter_root):
    apply(cluster, inference_service("runtime-lora", namespace, demo_model_dir,
                                     model={"source": f"file://{demo_model_dir}", "adapterRoot": str(adapter_root)}))
    wait_phase(cluster, namespace, "runtime-lora", "Ready", 1, timeout=300)

    with cluster.port_forward(kubeshard.namespace, f"service/{kubeshard.component('router')}", 8080) as port:
        url = f"http://127.0.0.1:{port}/v1"
        base = complete(url, "runtime-lora")
        assert base.status_code == 200, base.text
        assert complete(url, "alpha").status_code == 404  # not loaded yet

        loaded = httpx.post(url + "/load_lora_adapter", timeout=120, json={
            "lora_name": "alpha", "lora_path": "/lora-root/alpha", "model": "runtime-lora"})
        assert loaded.status_code == 200, loaded.text
        models = {m["id"]: m for m in httpx.get(url + "/models", timeout=30).json()["data"]}
        assert models["alpha"]["parent"] == "runtime-lora"
        tuned = complete(url, "alpha")
        assert tuned.status_code == 200, tuned.text
        assert tuned.json()["choices"][0]["text"] != base.json()["choices"][0]["text"]

        # a file the shard's user may not read is named as such (safetensors says "No such file")
        private = httpx.post(url + "/load_lora_adapter", timeout=120, json={
            "lora_name": "private", "lora_path": "/lora-root/private", "model": "runtime-lora"})
        assert private.status_code == 422, private.text
        assert "adapter_model.safetensors is not readable by this process (uid 10001" in private.text, private.text

        outside = httpx.post(url + "/load_lora_adapter", timeout=120, json={
            "lora_name": "beta", "lora_path": "/models/beta", "model": "runtime-lora"})
        assert outside.status_code == 422 and outside.json()["error"]["param"] == "lora_path", outside.text

        unloaded = httpx.post(url + "/unload_lora_adapter", timeout=120,
                              json={"lora_name": "alpha", "model": "runtime-lora"})
        assert unloaded.status_code == 200, unloaded.text
        assert complete(url, "alpha").status_code == 404
