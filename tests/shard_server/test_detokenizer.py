"""Streamed text deltas concatenate to exactly the decoded text; multi-byte characters intact."""

from __future__ import annotations

from kubeshard_shard.engine.detokenizer import IncrementalDetokenizer
from kubeshard_shard.models.config import load_model_config
from kubeshard_shard.tokenizer import load_tokenizer

TEXTS = [
    "plain ascii words, punctuation!",
    "accents: café, naïve, Ærøskøbing",
    "日本語のテキストと東京",
    "emoji 😀🚀 and mixed → ✓ €",
    "привет мир and مرحبا",
]


def test_deltas_concatenate_to_the_full_decode(demo_model):
    model = demo_model("llama")
    tok = load_tokenizer(model, load_model_config(model))
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok.tokenizer, [tok.encode("prompt")[0]], tok.special_ids)
        deltas = [detok.add(i) for i in ids]
        deltas.append(detok.flush())
        assert "".join(deltas) == tok.decode(ids) == text
        for d in deltas:  # no delta carries half a character
            assert "\ufffd" not in d


def test_byte_fallback_tokens_hold_back_partial_characters(demo_model):
    model = demo_model("llama")
    tok = load_tokenizer(model, load_model_config(model))
    ids = tok.encode("🚀", add_special_tokens=False)
    # the demo tokenizer splits this 4-byte emoji over several byte tokens
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok.tokenizer, [], tok.special_ids)
    deltas = [detok.add(i) for i in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "🚀"


def test_special_tokens_add_no_text(demo_model):
    model = demo_model("llama")
    tok = load_tokenizer(model, load_model_config(model))
    detok = IncrementalDetokenizer(tok.tokenizer, [], tok.special_ids)
    eos = next(iter(tok.eos_ids))
    assert detok.add(eos) == ""
