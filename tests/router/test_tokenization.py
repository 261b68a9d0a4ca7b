"""The router's tokenizer and chat template against transformers, on real demo checkpoints."""

from __future__ import annotations

import json

import pytest
import transformers

from kubeshard_router.tokenization import ChatTemplateError, ModelTokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Why is the sky blue?"},
     {"role": "assistant", "content": "Rayleigh scattering."}, {"role": "user", "content": "Ünïcödé ✓ 🚀"}],
]
PROMPTS = ["Hello world", "  leading spaces and\nnewlines\t", "Ünïcödé ✓ 🚀 <s> literal", "a" * 300]


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def checkpoint(request, demo_model):
    return demo_model(arch=request.param, size="tiny")


def load(path) -> ModelTokenizer:
    return ModelTokenizer((path / "tokenizer.json").read_bytes(), (path / "tokenizer_config.json").read_bytes())


def test_encoding_matches_transformers(checkpoint):
    ref = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    tok = load(checkpoint)
    for text in PROMPTS:
        assert tok.encode(text) == ref(text)["input_ids"]
        assert tok.encode(text, add_special_tokens=False) == ref(text, add_special_tokens=False)["input_ids"]


def test_chat_template_matches_transformers(checkpoint):
    ref = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    tok = load(checkpoint)
    assert tok.has_chat_template
    for messages in CONVERSATIONS:
        for gen in (True, False):
            expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert tok.apply_chat_template(messages, add_generation_prompt=gen) == expected
        ids = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if isinstance(ids, dict):
            ids = ids["input_ids"]
        assert tok.encode(tok.apply_chat_template(messages), add_special_tokens=False) == list(ids)


def test_the_default_models_chat_template_renders_as_transformers_renders_it():
    """SmolLM2-135M-Instruct's template (from its GGUF metadata; it adds a system prompt
    of its own when the conversation has none), rendered by the router and by
    transformers, on the converted folder and on transformers' own reading of the GGUF."""
    from kubeshard_shard.checkpoints import default_model_file, local_checkpoint

    source = default_model_file()
    folder = local_checkpoint(source)
    tok = load(folder)
    references = [transformers.AutoTokenizer.from_pretrained(str(folder)),
                  transformers.AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)]
    assert "You are a helpful AI assistant named SmolLM" in tok.apply_chat_template(CONVERSATIONS[0])
    for ref in references:
        for messages in CONVERSATIONS + [[{"role": "user", "content": "What is the capital of France?"}]]:
            for gen in (True, False):
                expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
                assert tok.apply_chat_template(messages, add_generation_prompt=gen) == expected
            ids = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
            ids = ids["input_ids"] if isinstance(ids, dict) else ids
            assert tok.encode(tok.apply_chat_template(messages), add_special_tokens=False) == list(ids)


def _with_template(checkpoint, template) -> ModelTokenizer:
    config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    return ModelTokenizer((checkpoint / "tokenizer.json").read_bytes(), json.dumps(config).encode())


def test_template_features_transformers_templates_use(demo_model):
    path = demo_model()
    template = ("{{ bos_token }}{% for m in messages %}{% generation %}{{ m['content'] | tojson }}"
                "{% endgeneration %}{% if loop.index > 5 %}{% break %}{% endif %}{% endfor %}"
                "{{ strftime_now('%Y') | length }}")
    tok = _with_template(path, template)
    assert tok.apply_chat_template([{"role": "user", "content": "é<b>"}]) == '<s>"é<b>"4'


def test_template_exception_and_named_templates(demo_model):
    path = demo_model()
    tok = _with_template(path, "{{ raise_exception('Conversation roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    named = _with_template(path, [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}])
    assert named.apply_chat_template([]) == "D"
    none = _with_template(path, None)
    assert not none.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat_template"):
        none.apply_chat_template([{"role": "user", "content": "x"}])


def test_empty_tokenizer_is_refused():
    with pytest.raises(ValueError, match="tokenizer_json is empty"):
        ModelTokenizer(b"", b"{}")
