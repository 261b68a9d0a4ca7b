"""GGUF files load: each supported quantization type gives the logits of its float
checkpoint (the same dequantized weights run by transformers); the tokenizer rebuilt
from the GGUF's keys encodes as the original; bad files get errors that say why."""

from __future__ import annotations

import json
import shutil
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from kubeshard_shard.checkpoints import local_checkpoint, served_name
from kubeshard_shard.engine.request import make_sampling_params
from kubeshard_shard.models.config import CheckpointError
from kubeshard_shard.models.gguf_checkpoint import QUANT_TYPES

from tests.support.engine import build_engine, hf_model, random_prompts, run_to_completion
from tests.support.gguf_files import write_gguf

K_QUANTS = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Conversions of the test files go to a cache of their own."""
    monkeypatch.setenv("KUBESHARD_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def wide_model(demo_model, tmp_path_factory) -> Path:
    """A llama-shaped checkpoint whose rows are multiples of 256, as K-quants need
    (the tiny demo model's 128-wide rows are not), with the demo tokenizer."""
    src = demo_model("mistral")
    out = tmp_path_factory.mktemp("wide") / "wide"
    out.mkdir()
    config = json.loads((src / "config.json").read_text())
    config.update(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / name, out / name)
    gen = torch.Generator().manual_seed(5)
    h, i, v, hd = 256, 512, config["vocab_size"], 64
    tensors = {"model.embed_tokens.weight": torch.randn(v, h, generator=gen) * 0.1,
               "model.norm.weight": 1 + torch.randn(h, generator=gen) * 0.1,
               "lm_head.weight": torch.randn(v, h, generator=gen) * 0.1}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        for name, shape in (("self_attn.q_proj", (4 * hd, h)), ("self_attn.k_proj", (2 * hd, h)),
                            ("self_attn.v_proj", (2 * hd, h)), ("self_attn.o_proj", (h, 4 * hd)),
                            ("mlp.gate_proj", (i, h)), ("mlp.up_proj", (i, h)), ("mlp.down_proj", (h, i))):
            tensors[p + name + ".weight"] = torch.randn(*shape, generator=gen) * 0.1
        for name in ("input_layernorm", "post_attention_layernorm"):
            tensors[p + name + ".weight"] = 1 + torch.randn(h, generator=gen) * 0.1
    save_file(tensors, str(out / "model.safetensors"))
    return out


def prompt_logprobs_and_greedy(model: Path, prompt: list[int], n: int) -> tuple[list[float], list[int]]:
    served = build_engine(model)
    params = make_sampling_params(max_new_tokens=n, ignore_eos=True, prefill_details=True)
    [outs] = run_to_completion(served.engine, [(prompt, params)])
    return [p.logprob for p in outs[0].prefill[1:]], [o.token_id for o in outs]


def hf_prompt_logprobs_and_greedy(model: Path, prompt: list[int], n: int) -> tuple[list[float], list[int]]:
    hf = hf_model(str(model))
    ids = torch.tensor([prompt])
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          pad_token_id=0)
    picked = logprobs[:-1].gather(1, ids[0, 1:, None])[:, 0]
    return picked.tolist(), out[0, len(prompt):].tolist()


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_each_quant_type_gives_the_logits_of_its_float_checkpoint(demo_model, wide_model, tmp_path, qtype):
    src = wide_model if qtype in K_QUANTS else demo_model("mistral")
    path = write_gguf(src, tmp_path / f"model-{qtype}.gguf", qtype, float_out=tmp_path / "float")
    prompt = random_prompts(1, 1000, (40, 40), seed=11)[0]
    got_lp, got_ids = prompt_logprobs_and_greedy(local_checkpoint(path), prompt, 12)
    want_lp, want_ids = hf_prompt_logprobs_and_greedy(tmp_path / "float", prompt, 12)
    torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(want_lp), rtol=1e-4, atol=1e-4)
    assert got_ids == want_ids


def test_qwen2_gguf_keeps_biases_and_tied_embeddings(demo_model, tmp_path):
    path = write_gguf(demo_model("qwen2"), tmp_path / "qwen.gguf", "Q8_0", float_out=tmp_path / "float")
    folder = local_checkpoint(path)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["tie_word_embeddings"] is True
    prompt = random_prompts(1, 1000, (30, 30), seed=12)[0]
    got_lp, got_ids = prompt_logprobs_and_greedy(folder, prompt, 10)
    want_lp, want_ids = hf_prompt_logprobs_and_greedy(tmp_path / "float", prompt, 10)
    torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(want_lp), rtol=1e-4, atol=1e-4)
    assert got_ids == want_ids


def test_tokenizer_and_chat_template_come_from_the_gguf_keys(demo_model, tmp_path):
    src = demo_model("llama")
    folder = local_checkpoint(write_gguf(src, tmp_path / "m.gguf", "F16"))
    original = Tokenizer.from_file(str(src / "tokenizer.json"))
    rebuilt = Tokenizer.from_file(str(folder / "tokenizer.json"))
    for text in ["Hello there, general Kenobi!", "  two  spaces\nand lines\n", "<|im_start|>user\nhi<|im_end|>",
                 "naïve café 東京 1234"]:
        assert rebuilt.encode(text).ids == original.encode(text).ids, text
        assert rebuilt.decode(rebuilt.encode(text).ids) == original.decode(original.encode(text).ids)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["chat_template"] == json.loads((src / "tokenizer_config.json").read_text())["chat_template"]
    assert config["eos_token"] == "</s>" and config["bos_token"] == "<s>"


def test_conversion_is_cached_and_keyed_by_content(demo_model, tmp_path):
    path = write_gguf(demo_model("mistral"), tmp_path / "m.gguf", "Q8_0")
    first = local_checkpoint(path)
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert local_checkpoint(path) == first and (first / "model.safetensors").stat().st_mtime_ns == mtime
    write_gguf(demo_model("mistral"), path, "Q4_0")  # same name, new content: a new conversion
    assert local_checkpoint(path) != first
    assert served_name(path) == "m"


def test_the_converted_checkpoint_is_readable_by_every_user(demo_model, tmp_path):
    """A pod's model server (uid 10001) reads a conversion the host's user wrote into a
    folder it mounts: the weights too (safetensors writes them 0600), as the other files."""
    folder = local_checkpoint(write_gguf(demo_model("mistral"), tmp_path / "m.gguf", "Q8_0"))
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in folder.iterdir()}
    assert "model.safetensors" in modes
    assert all(mode & 0o444 == 0o444 for mode in modes.values()), modes
    (folder / "model.safetensors").chmod(0o600)  # as conversions were cached before
    assert local_checkpoint(tmp_path / "m.gguf") == folder
    assert stat.S_IMODE((folder / "model.safetensors").stat().st_mode) == 0o644


def test_truncated_and_corrupt_files_are_refused_with_the_reason(demo_model, tmp_path):
    good = write_gguf(demo_model("mistral"), tmp_path / "good.gguf", "Q8_0").read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good[: len(good) * 2 // 3])
    with pytest.raises(CheckpointError, match="truncated|corrupt"):
        local_checkpoint(truncated)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        local_checkpoint(garbage)
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(CheckpointError, match="not a model"):
        local_checkpoint(text)


def test_unsupported_architecture_is_named_with_the_supported_ones(demo_model, tmp_path):
    path = write_gguf(demo_model("mistral"), tmp_path / "m.gguf", "Q8_0")
    value = len(b"llama").to_bytes(8, "little")  # GGUF strings: u64 length, then the bytes
    patched = tmp_path / "bloom.gguf"
    patched.write_bytes(path.read_bytes().replace(value + b"llama", value + b"bloom", 1))
    with pytest.raises(CheckpointError, match="architecture 'bloom' is not supported; supported: llama, qwen2"):
        local_checkpoint(patched)


def test_unsupported_quant_type_is_named_with_the_supported_ones(demo_model, tmp_path):
    """IQ4_NL has Q4_0's block and byte sizes, so only the type field changes."""
    import gguf

    path = write_gguf(demo_model("mistral"), tmp_path / "m.gguf", "Q4_0")
    reader = gguf.GGUFReader(str(path))
    tensor = next(t for t in reader.tensors if t.tensor_type == gguf.GGMLQuantizationType.Q4_0)
    type_part = tensor.field.parts[tensor.field.data[-2]]  # the tensor info's type field
    position = type_part.ctypes.data - reader.data.ctypes.data
    data = bytearray(path.read_bytes())
    assert int.from_bytes(data[position:position + 4], "little") == gguf.GGMLQuantizationType.Q4_0
    data[position:position + 4] = int(gguf.GGMLQuantizationType.IQ4_NL).to_bytes(4, "little")
    patched = tmp_path / "iq4.gguf"
    patched.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{tensor.name} has quantization type IQ4_NL, which is not "
                                              r"supported; supported: F32, F16, BF16, Q8_0"):
        local_checkpoint(patched)


def test_sentencepiece_tokenizer_is_refused_with_what_is_supported(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "spm.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for add in (writer.add_block_count, writer.add_embedding_length, writer.add_feed_forward_length,
                writer.add_head_count, writer.add_head_count_kv, writer.add_context_length):
        add(128)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>"])
    writer.add_tensor("token_embd.weight", np.zeros((3, 128), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match="tokenizer model 'llama' is not supported; supported: gpt2"):
        local_checkpoint(path)


def test_llama3_rope_freqs_give_the_logits_of_the_float_checkpoint(demo_model, tmp_path):
    """A Llama 3.1/3.2 GGUF carries its llama3 rope scaling only as ``rope_freqs.weight``
    (per-frequency divisors); served from the file, the model gives the logits that
    transformers gives for the float checkpoint with its llama3 rope_scaling."""
    src = demo_model("llama")
    assert json.loads((src / "config.json").read_text())["rope_scaling"]["rope_type"] == "llama3"
    path = write_gguf(src, tmp_path / "llama31.gguf", "Q8_0", float_out=tmp_path / "float")
    folder = local_checkpoint(path)
    config = json.loads((folder / "config.json").read_text())
    factors = config["rope_freq_factors"]
    assert len(factors) == config["head_dim"] // 2 and factors[0] == 1.0 and factors[-1] == 8.0
    assert any(1.0 < f < 8.0 for f in factors)  # the smoothed band is exercised too
    prompt = random_prompts(1, 1000, (120, 120), seed=13)[0]
    got_lp, got_ids = prompt_logprobs_and_greedy(folder, prompt, 12)
    want_lp, want_ids = hf_prompt_logprobs_and_greedy(tmp_path / "float", prompt, 12)
    torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(want_lp), rtol=1e-4, atol=1e-4)
    assert got_ids == want_ids
    # the factors matter: the same folder without them is another model
    plain = tmp_path / "plain"
    shutil.copytree(folder, plain)
    del config["rope_freq_factors"]
    (plain / "config.json").write_text(json.dumps(config))
    plain_lp, _ = prompt_logprobs_and_greedy(plain, prompt, 1)
    assert (torch.tensor(plain_lp) - torch.tensor(want_lp)).abs().max() > 1e-2


def test_rope_freqs_of_the_wrong_size_are_refused_naming_the_tensor(demo_model, tmp_path):
    import gguf
    import numpy as np

    path = write_gguf(demo_model("llama"), tmp_path / "m.gguf", "F16")
    reader = gguf.GGUFReader(str(path))
    tensor = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    start = tensor.data.ctypes.data - reader.data.ctypes.data
    data = bytearray(path.read_bytes())
    data[start:start + 4] = np.float32(-1.0).tobytes()  # a divisor that is no frequency factor
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"rope_freqs.weight must hold \d+ positive factors"):
        local_checkpoint(bad)


@pytest.mark.parametrize("qtype, dtype", [("F32", "float32"), ("F16", "float16"), ("Q8_0", "bfloat16")])
def test_auto_dtype_is_the_type_the_weights_came_in(demo_model, tmp_path, qtype, dtype):
    folder = local_checkpoint(write_gguf(demo_model("mistral"), tmp_path / "m.gguf", qtype))
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == dtype


def test_the_file_type_key_says_the_dtype_when_present(demo_model, tmp_path):
    path = write_gguf(demo_model("mistral"), tmp_path / "m.gguf", "F32", metadata={"general.file_type": 0})
    assert json.loads((local_checkpoint(path) / "config.json").read_text())["torch_dtype"] == "float32"
    path = write_gguf(demo_model("mistral"), tmp_path / "q.gguf", "Q8_0", metadata={"general.file_type": 7})
    assert json.loads((local_checkpoint(path) / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_unsupported_pre_tokenizer_is_named_with_the_supported_ones(demo_model, tmp_path):
    path = write_gguf(demo_model("mistral"), tmp_path / "m.gguf", "Q8_0", pre="chatglm-bpe")
    with pytest.raises(CheckpointError, match=r"pre-tokenizer 'chatglm-bpe' is not supported; supported: .*llama-bpe"):
        local_checkpoint(path)


def test_unsupported_rope_scaling_is_named_with_the_supported_ones(demo_model, tmp_path):
    path = write_gguf(demo_model("mistral"), tmp_path / "m.gguf", "Q8_0", metadata={"llama.rope.scaling.type": "yarn"})
    with pytest.raises(CheckpointError, match="GGUF rope scaling 'yarn' is not supported; supported: none, linear"):
        local_checkpoint(path)


def test_a_read_only_cache_is_named_with_the_setting_that_moves_it(demo_model, tmp_path, monkeypatch):
    """The cache folder is made read-only with its mode, and for root (whom modes do not
    stop) with the immutable attribute."""
    import os
    import subprocess

    path = write_gguf(demo_model("mistral"), tmp_path / "m.gguf", "Q8_0")
    cache = tmp_path / "ro-cache"
    (cache / "models").mkdir(parents=True)
    monkeypatch.setenv("KUBESHARD_CACHE", str(cache))
    (cache / "models").chmod(0o555)
    immutable = os.geteuid() == 0
    if immutable:
        done = subprocess.run(["chattr", "+i", str(cache / "models")], capture_output=True, text=True)
        if done.returncode:
            pytest.fail(f"cannot make a read-only folder as root here (chattr +i: {done.stderr.strip()})")
    try:
        with pytest.raises(CheckpointError) as err:
            local_checkpoint(path)
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(cache / "models")], check=True)
        (cache / "models").chmod(0o755)
    message = str(err.value)
    assert f"cache folder {cache / 'models'}" in message and "KUBESHARD_CACHE" in message
    assert "shardServer.cacheDir" in message and "m.gguf" in message
