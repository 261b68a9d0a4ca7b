"""Deterministic demo checkpoints: random weights, a locally trained tokenizer, no download.

``write_demo_model`` writes a Hugging Face folder that transformers loads unchanged:
config.json, model.safetensors (sharded with an index for ``small``),
generation_config.json, tokenizer.json (byte-level BPE trained here with the
``tokenizers`` library) and tokenizer_config.json with a ChatML chat template.

Weights are drawn with a standard deviation of 0.1: with the usual 0.02 a random model
repeats one token forever, and identity tests on it would prove little.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from kubeshard_shard.paths import build_once, save_safetensors

# Bump when the written files change, so cached folders of an older format are rebuilt.
FORMAT_VERSION = 1

ARCHES = ("llama", "qwen2", "mistral")
SIZES = ("tiny", "small")

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    max_positions: int


SHAPES = {
    # Small enough for fast tests, yet GQA (8 query / 4 KV heads) and divisible by 2 and 4
    # so the sharding tests can split it.
    "tiny": Shape(hidden=128, intermediate=352, layers=2, heads=8, kv_heads=4, vocab=1024, max_positions=4096),
    # The benchmark shape fixed by the engine issue (~32M parameters).
    "small": Shape(hidden=512, intermediate=1408, layers=8, heads=8, kv_heads=4, vocab=8192, max_positions=4096),
}

_ONSETS = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
           "br", "ch", "cl", "dr", "gr", "pl", "qu", "sh", "st", "th", "tr"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "io", "y"]
_CODAS = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck"]
_MULTIBYTE = ["é", "ü", "ñ", "ß", "ø", "日本", "語", "東京", "€", "✓", "→", "😀", "🚀", "Ωμ", "привет", "مرحبا"]


def _corpus(seed: int, words: int) -> list[str]:
    """Pseudo-text from a seeded syllable generator, with multi-byte characters mixed in
    so that the tokenizer has merges inside UTF-8 sequences (and the detokenizer gets
    exercised on split characters)."""
    rng = random.Random(seed)
    lexicon = []
    for _ in range(6000):
        syllables = rng.choice((1, 1, 2, 2, 2, 3, 3, 4))
        lexicon.append("".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                               for _ in range(syllables)))
    weights = [1.0 / (rank + 1) for rank in range(len(lexicon))]  # Zipf-like frequencies
    lines, line = [], []
    for word in rng.choices(lexicon, weights=weights, k=words):
        r = rng.random()
        if r < 0.02:
            word = rng.choice(_MULTIBYTE)
        elif r < 0.05:
            word = word.capitalize()
        elif r < 0.07:
            word = str(rng.randint(0, 9999))
        line.append(word)
        if rng.random() < 0.08:
            line[-1] += rng.choice([".", ",", "?", "!", ":"])
        if len(line) > rng.randint(6, 20):
            lines.append(" ".join(line))
            line = []
    lines.append(" ".join(line))
    return lines


def train_tokenizer(vocab_size: int, seed: int, add_bos: bool):
    """A byte-level BPE tokenizer with exactly ``vocab_size`` entries."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        min_frequency=1,
    )
    words = 60_000 if vocab_size <= 2048 else 400_000
    tok.train_from_iterator(_corpus(seed, words), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"demo tokenizer has {tok.get_vocab_size()} entries, expected {vocab_size}; enlarge the corpus"
        )
    if add_bos:
        bos_id = tok.token_to_id(BOS)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _config(arch: str, shape: Shape, bos_id: int, eos_id: int, pad_id: int) -> dict:
    common = {
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "vocab_size": shape.vocab,
        "max_position_embeddings": shape.max_positions,
        "hidden_act": "silu",
        "initializer_range": 0.1,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "torch_dtype": "float32",
        "use_cache": True,
        "attention_dropout": 0.0,
    }
    if arch == "llama":
        # Llama 3 style: large theta and llama3 rope scaling, so that path is exercised.
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", **common,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 512},
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
            "pretraining_tp": 1,
        }
    if arch == "mistral":
        return {
            "architectures": ["MistralForCausalLM"], "model_type": "mistral", **common,
            "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "sliding_window": None,
            "tie_word_embeddings": False,
        }
    if arch == "qwen2":
        # Qwen2: q/k/v biases and tied embeddings (as the small Qwen2 models have).
        return {
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **common,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "use_sliding_window": False,
            "sliding_window": None, "max_window_layers": shape.layers, "tie_word_embeddings": True,
        }
    raise ValueError(f"unknown demo architecture '{arch}'; choose one of {', '.join(ARCHES)}")


def _weights(arch: str, shape: Shape, seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)

    def randn(*size, std=0.1):
        return (torch.randn(*size, generator=g) * std).contiguous()

    h, i, hd = shape.hidden, shape.intermediate, shape.hidden // shape.heads
    q, kv = shape.heads * hd, shape.kv_heads * hd
    w = {"model.embed_tokens.weight": randn(shape.vocab, h)}
    for layer in range(shape.layers):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = 1.0 + randn(h)
        w[p + "post_attention_layernorm.weight"] = 1.0 + randn(h)
        w[p + "self_attn.q_proj.weight"] = randn(q, h)
        w[p + "self_attn.k_proj.weight"] = randn(kv, h)
        w[p + "self_attn.v_proj.weight"] = randn(kv, h)
        w[p + "self_attn.o_proj.weight"] = randn(h, q)
        if arch == "qwen2":
            w[p + "self_attn.q_proj.bias"] = randn(q)
            w[p + "self_attn.k_proj.bias"] = randn(kv)
            w[p + "self_attn.v_proj.bias"] = randn(kv)
        w[p + "mlp.gate_proj.weight"] = randn(i, h)
        w[p + "mlp.up_proj.weight"] = randn(i, h)
        w[p + "mlp.down_proj.weight"] = randn(h, i)
    w["model.norm.weight"] = 1.0 + randn(h)
    if arch != "qwen2":
        w["lm_head.weight"] = randn(shape.vocab, h)
    return w


def _save_weights(weights: dict, out: Path, sharded: bool) -> None:
    meta = {"format": "pt"}
    if not sharded:
        save_safetensors(weights, out / "model.safetensors", meta)
        return
    names = list(weights)
    half = len(names) // 2
    parts = [names[:half], names[half:]]
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in weights.values())},
             "weight_map": {}}
    for n, part in enumerate(parts, start=1):
        fname = f"model-{n:05d}-of-{len(parts):05d}.safetensors"
        save_safetensors({k: weights[k] for k in part}, out / fname, meta)
        for k in part:
            index["weight_map"][k] = fname
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def write_demo_model(out_dir: Path | str, arch: str = "llama", size: str = "tiny", seed: int = 0) -> Path:
    """Writes a demo checkpoint into ``out_dir`` (created; must be empty if it exists)."""
    if arch not in ARCHES:
        raise ValueError(f"unknown --arch '{arch}'; choose one of {', '.join(ARCHES)}")
    if size not in SIZES:
        raise ValueError(f"unknown --size '{size}'; choose one of {', '.join(SIZES)}")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"--seed must be a non-negative integer, got {seed!r}")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"output folder {out} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)

    shape = SHAPES[size]
    add_bos = arch != "qwen2"  # Qwen2 tokenizers add no BOS
    tok = train_tokenizer(shape.vocab, seed, add_bos=add_bos)
    tok.save(str(out / "tokenizer.json"))
    bos_id, eos_id, pad_id = (tok.token_to_id(t) for t in (BOS, EOS, PAD))

    (out / "config.json").write_text(json.dumps(_config(arch, shape, bos_id, eos_id, pad_id), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id, "do_sample": False},
        indent=2) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS if add_bos else None,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": shape.max_positions,
        "chat_template": CHAT_TEMPLATE,
        "model_input_names": ["input_ids", "attention_mask"],
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                      "normalized": False, "single_word": False}
            for t in SPECIAL_TOKENS
        },
    }, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, indent=2) + "\n")

    _save_weights(_weights(arch, shape, seed), out, sharded=(size == "small"))
    (out / "README.md").write_text(
        f"kubeshard demo checkpoint: arch={arch} size={size} seed={seed} (random weights, for tests "
        "and benchmarks only; it generates gibberish).\n")
    return out


def cached_demo_model(root: Path | str, arch: str = "llama", size: str = "tiny", seed: int = 0) -> Path:
    """Returns a demo checkpoint under ``root``, writing it once (safe across processes)."""
    target = Path(root) / f"{arch}-{size}-seed{seed}-v{FORMAT_VERSION}"
    return build_once(target, lambda out: write_demo_model(out, arch=arch, size=size, seed=seed))
