"""Demo checkpoints, and clear errors for every kind of bad model folder."""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
import sys

import pytest
import torch

from kubeshard_shard.demo_model import write_demo_model
from kubeshard_shard.models.config import CheckpointError
from tests.support.engine import build_engine


def test_demo_model_is_deterministic(tmp_path):
    a = write_demo_model(tmp_path / "a", "qwen2", "tiny", seed=3)
    b = write_demo_model(tmp_path / "b", "qwen2", "tiny", seed=3)
    c = write_demo_model(tmp_path / "c", "qwen2", "tiny", seed=4)
    for name in ("config.json", "tokenizer.json", "model.safetensors", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_demo_model_files_are_readable_by_every_user(tmp_path):
    """Pods (uid 10001) mount demo models the host's user wrote: the weights too, one
    file or several (safetensors writes them 0600)."""
    for size in ("tiny", "small"):
        folder = write_demo_model(tmp_path / size, "llama", size)
        modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in folder.iterdir()}
        assert sum(name.endswith(".safetensors") for name in modes) == (1 if size == "tiny" else 2)
        assert all(mode & 0o444 == 0o444 for mode in modes.values()), modes


def test_small_demo_model_has_the_benchmark_shape_and_loads_in_transformers(demo_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = demo_model("llama", "small")
    config = json.loads((path / "config.json").read_text())
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"],
            config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == (
        512, 1408, 8, 8, 4, 8192)
    assert (path / "model.safetensors.index.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert 31_000_000 < sum(p.numel() for p in model.parameters()) < 33_000_000
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.vocab_size == 8192 or len(tok) == 8192
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_tiny_demo_models_load_in_transformers(demo_model, arch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(demo_model(arch), dtype=torch.float32)
    assert type(model).__name__.lower().startswith(arch)


def test_cli_writes_a_demo_model(tmp_path):
    out = tmp_path / "m"
    r = subprocess.run([sys.executable, "-m", "kubeshard_shard.cli", "demo-model", str(out), "--arch", "mistral"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "config.json").read_text())["architectures"] == ["MistralForCausalLM"]
    r = subprocess.run([sys.executable, "-m", "kubeshard_shard.cli", "demo-model", str(out)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "not empty" in r.stderr


@pytest.fixture
def model_copy(demo_model, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(demo_model("llama"), dst)
    return dst


def expect_error(path, *fragments):
    with pytest.raises(CheckpointError) as info:
        build_engine(path)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_missing_model_folder(tmp_path):
    expect_error(tmp_path / "nope", "does not exist")


def test_corrupt_safetensors(model_copy):
    (model_copy / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    expect_error(model_copy, "model.safetensors", "corrupt or truncated")


def test_truncated_safetensors(model_copy):
    data = (model_copy / "model.safetensors").read_bytes()
    (model_copy / "model.safetensors").write_bytes(data[: len(data) // 2])
    expect_error(model_copy, "model.safetensors")


def test_unsupported_architecture(model_copy):
    config = json.loads((model_copy / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model_copy / "config.json").write_text(json.dumps(config))
    expect_error(model_copy, "GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


@pytest.mark.parametrize("factors", [[1.0] * 3, [1.0] * 7 + [0.0], "8"])
def test_bad_rope_freq_factors_are_named(model_copy, factors):
    config = json.loads((model_copy / "config.json").read_text())
    config["rope_freq_factors"] = factors  # head_dim 16: 8 factors, all positive
    (model_copy / "config.json").write_text(json.dumps(config))
    expect_error(model_copy, "config.json", "'rope_freq_factors' must be a list of 8 positive numbers")


def test_tokenizer_that_does_not_match_the_model(model_copy, demo_model):
    shutil.copy(demo_model("llama", "small") / "tokenizer.json", model_copy / "tokenizer.json")
    expect_error(model_copy, "8192 tokens", "vocab_size is 1024")


def test_missing_tensor(model_copy):
    from safetensors.torch import load_file, save_file

    tensors = load_file(model_copy / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, model_copy / "model.safetensors")
    expect_error(model_copy, "lacks tensors", "gate_up_proj")


def test_wrong_tensor_shape(model_copy):
    from safetensors.torch import load_file, save_file

    tensors = load_file(model_copy / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(7)
    save_file(tensors, model_copy / "model.safetensors")
    expect_error(model_copy, "model.norm.weight", "(7,)")


def test_serve_shard_exits_with_the_message(model_copy):
    (model_copy / "model.safetensors").write_bytes(b"broken")
    r = subprocess.run([sys.executable, "-m", "kubeshard_shard.cli", "serve-shard", "--model", str(model_copy),
                        "--port", "0", "--metrics-port", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "corrupt or truncated" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("flags,fragment", [
    (["--kv-cache-memory", "lots"], "--kv-cache-memory"),
    (["--max-batch-tokens", "0"], "--max-batch-tokens"),
    (["--max-input-tokens", "100", "--max-total-tokens", "50"], "--max-input-tokens"),
    (["--dtype", "int4"], "--dtype"),
    (["--strategy", "pipeline"], "--strategy"),
])
def test_bad_flags_are_named(model_copy, flags, fragment):
    r = subprocess.run([sys.executable, "-m", "kubeshard_shard.cli", "serve-shard", "--model", str(model_copy),
                        "--port", "0", "--metrics-port", "0", *flags], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert fragment in r.stderr and "Traceback" not in r.stderr
