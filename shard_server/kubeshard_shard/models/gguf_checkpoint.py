"""GGUF files (llama.cpp's format) as checkpoints: read with the ``gguf`` package,
dequantized, and written once as a Hugging Face folder that the rest of the server
loads like any other (memory-mapped safetensors, per-rank slices for sharding).

What maps to what:
- the config from the ``{arch}.*`` keys (block_count, embedding_length, head counts,
  rope.freq_base, rope.scaling.*, context_length, ...); tied embeddings when the file
  has no ``output.weight``; Llama 3.1/3.2's ``rope_freqs.weight`` as the per-frequency
  divisors ``rope_freq_factors`` (kubeshard's field: transformers would ignore it);
- tensors by name (``blk.N.attn_q.weight`` -> ``model.layers.N.self_attn.q_proj.weight``);
  llama.cpp's converter interleaves the rotary halves of Llama's q and k rows, which is
  undone here (Qwen2 files are written unpermuted);
- the tokenizer from ``tokenizer.ggml.*`` (byte-level BPE: tokens, merges, token types,
  the pre-tokenizer named by ``tokenizer.ggml.pre``), the chat template from
  ``tokenizer.chat_template``, BOS/EOS from their ids.

Every quantized tensor becomes float32 here (F16 and BF16 stay as they are) and the
engine casts to the requested dtype when it loads; the folder also lists each tensor's
GGUF type (``gguf_tensor_types.json``), so that ``--quantize gguf`` packs Q8_0, Q4_0 and
Q4_1 weights back into the very same bytes (``models.quant``) and keeps them so.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from kubeshard_shard.models.config import CheckpointError
from kubeshard_shard.paths import build_once, save_safetensors

log = logging.getLogger(__name__)

# Bump when the written folder changes, so older conversions are rebuilt.
FORMAT_VERSION = 3
TENSOR_TYPES_FILE = "gguf_tensor_types.json"  # Hugging Face tensor name -> GGUF type
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
QUANT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
TOKENIZER_MODELS = ("gpt2",)
# tokenizer.ggml.pre -> how text is split before BPE (llama.cpp's llama-vocab.cpp regexes)
DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone")
GPT2_PRE = ("default", "gpt2", "mpt", "olmo", "jais", "")
LLAMA3_PRE = ("llama3", "llama-bpe", "llama-v3", "falcon3", "deepseek-r1-qwen", "qwen2", "smaug-bpe")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4

_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"


def open_gguf(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError, struct errors, numpy errors...
        raise CheckpointError(f"{path}: not a readable GGUF file (corrupt or truncated: {exc})") from exc


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        return field.contents()
    except Exception as exc:
        raise CheckpointError(f"GGUF metadata '{key}' is unreadable ({exc})") from exc


def _require(reader, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise CheckpointError(f"GGUF metadata lacks '{key}'")
    return value


def hf_config(reader) -> dict:
    arch = _require(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"GGUF architecture '{arch}' is not supported; supported: {', '.join(ARCHITECTURES)}")
    heads = int(_require(reader, f"{arch}.attention.head_count"))
    hidden = int(_require(reader, f"{arch}.embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    names = {t.name for t in reader.tensors}
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(_require(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_require(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "vocab_size": int(_field(reader, f"{arch}.vocab_size", len(tokens))),
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": _torch_dtype(reader),
    }
    if arch == "qwen2":
        config["use_sliding_window"] = False
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling in ("linear",):
        config["rope_scaling"] = {"rope_type": "linear",
                                  "factor": float(_require(reader, f"{arch}.rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise CheckpointError(f"GGUF rope scaling '{scaling}' is not supported; supported: none, linear")
    factors = _rope_freq_factors(reader, config["head_dim"])
    if factors is not None:
        config["rope_freq_factors"] = factors
    for key, name in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        value = _field(reader, name)
        if value is not None:
            config[key] = int(value)
    return config


# general.file_type (llama.cpp's LlamaFileType) -> the float type the weights came in
FILE_TYPE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}
TENSOR_TYPE_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def _torch_dtype(reader) -> str:
    """What ``--dtype auto`` serves: the file's float type (general.file_type, or its
    weights' types when the key is absent); bfloat16 for a quantized file."""
    file_type = _field(reader, "general.file_type")
    if file_type is not None:
        return FILE_TYPE_DTYPES.get(int(file_type), "bfloat16")
    from gguf import GGMLQuantizationType

    kinds = {GGMLQuantizationType(t.tensor_type).name for t in reader.tensors if len(t.shape) > 1}
    floats = {TENSOR_TYPE_DTYPES.get(kind) for kind in kinds}
    return floats.pop() if len(floats) == 1 and None not in floats else "bfloat16"


def _rope_freq_factors(reader, head_dim: int) -> list[float] | None:
    """llama.cpp's ``rope_freqs.weight`` (written for Llama 3.1/3.2 in place of their
    llama3 rope_scaling): the divisor of each rotary frequency. The GGUF keeps no
    factor/low_freq_factor/high_freq_factor/original context length to rebuild
    transformers' llama3 rope_scaling from, so the divisors go into the config as they
    are (kubeshard's ``rope_freq_factors``, which ``rope_inverse_frequencies`` applies)."""
    from gguf import GGMLQuantizationType, quants

    tensor = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if tensor is None:
        return None
    qtype = GGMLQuantizationType(tensor.tensor_type)
    try:
        values = np.asarray(quants.dequantize(tensor.data, qtype), dtype=np.float64).reshape(-1)
    except Exception as exc:
        raise CheckpointError(f"GGUF tensor rope_freqs.weight ({qtype.name}) cannot be read: the file is "
                              f"truncated or corrupt ({exc})") from exc
    if values.size != head_dim // 2 or not (np.isfinite(values).all() and (values > 0).all()):
        raise CheckpointError(f"GGUF tensor rope_freqs.weight must hold {head_dim // 2} positive factors (one per "
                              f"rotary frequency of head dimension {head_dim}); it holds {values.size}"
                              + ("" if np.isfinite(values).all() and (values > 0).all() else
                                 ", some not positive and finite"))
    return [float(x) for x in values]


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's interleaving of the rotary halves of each head's rows."""
    return rows.reshape(heads, rows.shape[0] // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def hf_name(name: str) -> str | None:
    stem, _, kind = name.rpartition(".")
    if stem in _TOP:
        return f"{_TOP[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{kind}"
    return None


def hf_tensors(reader, config: dict, types: dict[str, str] | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (Hugging Face name, dequantized array) for every tensor the model uses;
    records each one's GGUF type in ``types``."""
    from gguf import GGMLQuantizationType, quants

    permute = config["model_type"] == "llama"
    for t in reader.tensors:
        qtype = GGMLQuantizationType(t.tensor_type)
        name = hf_name(t.name)
        if name is None:
            if t.name != "rope_freqs.weight":  # read into the config by hf_config
                log.warning("GGUF tensor %s has no place in the model; ignored", t.name)
            continue
        if qtype.name not in QUANT_TYPES:
            raise CheckpointError(f"GGUF tensor {t.name} has quantization type {qtype.name}, which is not "
                                  f"supported; supported: {', '.join(QUANT_TYPES)}")
        if types is not None:
            types[name] = qtype.name
        shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists the fastest dimension first
        try:
            values = quants.dequantize(t.data, qtype) if qtype.name not in ("F32", "F16") else np.asarray(t.data)
            values = values.reshape(shape)
        except Exception as exc:
            raise CheckpointError(f"GGUF tensor {t.name} ({qtype.name}, shape {shape}) cannot be read: "
                                  f"the file is truncated or corrupt ({exc})") from exc
        if values.dtype not in (np.float32, np.float16):
            values = values.astype(np.float32)
        if permute and name.endswith("q_proj.weight"):
            values = _unpermute(values, config["num_attention_heads"])
        elif permute and name.endswith("k_proj.weight"):
            values = _unpermute(values, config["num_key_value_heads"])
        if not np.isfinite(values).all():
            raise CheckpointError(f"GGUF tensor {t.name} holds NaN or infinite values (corrupt file?)")
        yield name, values


def hf_tokenizer(reader) -> tuple[str, dict]:
    """(tokenizer.json text, tokenizer_config.json dict) from the GGUF's tokenizer keys."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    kind = _require(reader, "tokenizer.ggml.model")
    if kind not in TOKENIZER_MODELS:
        raise CheckpointError(f"GGUF tokenizer model '{kind}' is not supported; supported: "
                              f"{', '.join(TOKENIZER_MODELS)} (byte-level BPE)")
    tokens = list(_require(reader, "tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in _require(reader, "tokenizer.ggml.merges")]
    types = list(_field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens))
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in DIGITS_THEN_GPT2:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in GPT2_PRE:
        tok.pre_tokenizer = byte_level
    elif pre in LLAMA3_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        raise CheckpointError(f"GGUF pre-tokenizer '{pre}' is not supported; supported: "
                              f"{', '.join(sorted(set(DIGITS_THEN_GPT2 + GPT2_PRE + LLAMA3_PRE) - {''}))}")
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind_ in zip(tokens, types) if kind_ == TOKEN_CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind_ in zip(tokens, types) if kind_ == TOKEN_USER_DEFINED])
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False))
    config: dict[str, Any] = {"add_bos_token": add_bos, "add_eos_token": False,
                              "clean_up_tokenization_spaces": False, "tokenizer_class": "PreTrainedTokenizerFast"}
    for key, name in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                      ("pad_token", "padding_token_id")):
        value = _field(reader, f"tokenizer.ggml.{name}")
        if value is not None and 0 <= int(value) < len(tokens):
            config[key] = tokens[int(value)]
    if add_bos and "bos_token" in config:
        from tokenizers import processors

        bos = config["bos_token"]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tokens.index(bos))])
    template = _field(reader, "tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return tok.to_str(), config


def convert(path: Path, out: Path) -> None:
    """Writes the Hugging Face folder of the GGUF file ``path`` into ``out``."""
    import torch

    reader = open_gguf(path)
    config = hf_config(reader)
    tokenizer_json, tokenizer_config = hf_tokenizer(reader)
    types: dict[str, str] = {}
    tensors = {name: torch.from_numpy(np.array(values, copy=True))
               for name, values in hf_tensors(reader, config, types)}
    if "model.embed_tokens.weight" not in tensors:
        raise CheckpointError(f"{path}: the GGUF file has no token_embd.weight")
    out.mkdir(parents=True)
    save_safetensors(tensors, out / "model.safetensors", {"format": "pt", "source": path.name})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / TENSOR_TYPES_FILE).write_text(json.dumps(types, indent=2, sort_keys=True))
    (out / "tokenizer.json").write_text(tokenizer_json)
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))


def _digest(path: Path) -> str:
    h = hashlib.sha256(f"v{FORMAT_VERSION}:".encode())
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()[:20]


def converted_checkpoint(path: Path, cache: Path) -> Path:
    """The Hugging Face folder of a GGUF file, converted once and cached under ``cache``
    (keyed by the file's content)."""
    target = cache / f"{path.stem}-{_digest(path)}"
    if not (target / "config.json").is_file():
        log.info("converting %s to a checkpoint folder under %s (once)", path, cache)
    try:
        folder = build_once(target, lambda out: convert(path, out))
    except OSError as exc:
        raise CheckpointError(
            f"cannot write the converted checkpoint of {path.name} into the cache folder {cache} "
            f"({exc.strerror or exc}); point KUBESHARD_CACHE at a writable folder (on Kubernetes: the chart's "
            f"shardServer.cacheDir, or leave it empty for the pod's own /tmp)") from exc
    weights = folder / "model.safetensors"
    try:  # conversions cached before 2026-12-07 kept safetensors' 0600 (save_safetensors)
        if weights.stat().st_mode & 0o444 != 0o444:
            weights.chmod(0o644)
    except OSError:  # another user's cache: it reads as it is
        pass
    return folder
