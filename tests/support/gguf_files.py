"""GGUF files for tests, written with the ``gguf`` package from a Hugging Face folder, the
way llama.cpp's converter writes them (q/k rows interleaved for Llama, the tokenizer as
``tokenizer.ggml.*`` keys, a llama3 rope_scaling as the ``rope_freqs.weight`` tensor), in
any quantization type; and the float checkpoint that
holds exactly the dequantized weights, for comparing logits.

gguf-py cannot quantize to the K-quants (Q2_K..Q6_K) in numpy, so those tensors are
random but valid blocks (finite float16 scales): the comparison stays exact, since the
float checkpoint is the dequantization of the very same bytes.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

K_QUANT_SCALES = {  # byte offsets of a block's float16 scale fields (ggml-common.h)
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}
GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_name(name: str) -> str:
    if name in GGUF_NAMES:
        return GGUF_NAMES[name]
    _, _, i, *rest = name.split(".")
    module, kind = ".".join(rest[:-1]), rest[-1]
    return f"blk.{i}.{LAYER_NAMES[module]}.{kind}"


def permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf interleaving of each head's rotary halves."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    return rows.reshape(heads, rows.shape[0] // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def llama3_rope_factors(config: dict) -> np.ndarray | None:
    """The ``rope_freqs.weight`` llama.cpp's convert_hf_to_gguf writes for a llama3
    rope_scaling (LlamaModel.generate_extra_tensors): each rotary frequency's divisor.
    The context length is rope_scaling's original_max_position_embeddings, the one
    transformers uses (llama.cpp reads only a top-level key, 8192 when absent, which is
    Llama 3.1's value)."""
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
        return None
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    freqs = 1.0 / (config.get("rope_theta", 10000.0) ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = scaling.get("factor", 8.0), scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings") or config.get("original_max_position_embeddings", 8192)
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _random_k_blocks(shape: tuple[int, int], qtype, rng: np.random.Generator) -> np.ndarray:
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(shape[0], shape[1] // block, size), dtype=np.uint8)
    for offset in K_QUANT_SCALES[qtype.name]:
        scale = rng.uniform(0.002, 0.01, size=blocks.shape[:2]).astype(np.float16)
        blocks[:, :, offset:offset + 2] = scale.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(shape[0], -1)


def write_gguf(src: Path, path: Path, qtype_name: str, float_out: Path | None = None, seed: int = 0,
               metadata: dict | None = None, pre: str = "default") -> Path:
    """Writes ``src`` (a Hugging Face folder of a llama/mistral/qwen2 model) as a GGUF file
    with its 2-D weights in ``qtype_name``; with ``float_out``, also writes the float
    checkpoint of exactly the weights the GGUF holds."""
    import gguf
    from gguf import GGMLQuantizationType as T

    config = json.loads((src / "config.json").read_text())
    arch = "qwen2" if config["model_type"] == "qwen2" else "llama"
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    qtype = T[qtype_name]
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(src.name)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    writer.add_vocab_size(config["vocab_size"])
    _add_tokenizer(writer, src, pre)
    for key, value in (metadata or {}).items():
        writer.add_string(key, value) if isinstance(value, str) else writer.add_uint32(key, value)
    dequantized = {}
    factors = llama3_rope_factors(config)
    if factors is not None:  # as llama.cpp's converter writes Llama 3.1/3.2
        writer.add_tensor("rope_freqs.weight", factors, raw_dtype=T.F32)
    for name, tensor in tensors.items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        values = tensor.float().numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            values = permute(values, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            values = permute(values, kv_heads)
        if values.ndim == 1 or qtype == T.F32:
            data, kind = values.astype(np.float32), T.F32
        elif qtype.name in K_QUANT_SCALES:
            data, kind = _random_k_blocks(values.shape, qtype, rng), qtype
        else:
            data, kind = gguf.quants.quantize(values, qtype), qtype
        writer.add_tensor(gguf_name(name), data, raw_dtype=kind)
        back = gguf.quants.dequantize(data, kind).reshape(values.shape).astype(np.float32)
        if arch == "llama" and name.endswith("q_proj.weight"):
            back = unpermute(back, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            back = unpermute(back, kv_heads)
        dequantized[name] = torch.from_numpy(np.array(back))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if float_out is not None:
        float_out.mkdir(parents=True)
        for f in src.iterdir():
            if f.is_file() and not f.name.startswith("model.safetensors"):
                shutil.copy(f, float_out / f.name)
        save_file(dequantized, str(float_out / "model.safetensors"))
    return path


def _add_tokenizer(writer, src: Path, pre: str) -> None:
    tok = json.loads((src / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    special = {t["content"] for t in tok.get("added_tokens", []) if t.get("special")}
    tok_config = json.loads((src / "tokenizer_config.json").read_text())
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    for key, add in (("bos_token", writer.add_bos_token_id), ("eos_token", writer.add_eos_token_id)):
        if tok_config.get(key) in vocab:
            add(vocab[tok_config[key]])
    writer.add_add_bos_token(tok.get("post_processor", {}).get("type") == "TemplateProcessing")
    if tok_config.get("chat_template"):
        writer.add_chat_template(tok_config["chat_template"])
