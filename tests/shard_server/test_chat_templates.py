"""Chat templates from every place checkpoints keep them, in transformers' precedence:
chat_template.jinja, then chat_template.json, then tokenizer_config.json (where a
GGUF file's template lands); and a model whose template is only in chat_template.jinja
serves /v1/chat/completions through the router."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from kubeshard_shard.models.config import load_model_config
from kubeshard_shard.tokenizer import chat_template, load_tokenizer

from tests.support.servers import start_router, start_shard

JINJA = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
LEGACY = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


@pytest.fixture
def model_copy(demo_model, tmp_path) -> Path:
    out = tmp_path / "model"
    shutil.copytree(demo_model("llama"), out)
    return out


def _config(folder: Path) -> dict:
    return json.loads((folder / "tokenizer_config.json").read_text())


def _without_config_template(folder: Path) -> str:
    config = _config(folder)
    original = config.pop("chat_template")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return original


def test_precedence_is_jinja_then_json_then_tokenizer_config(model_copy):
    in_config = _config(model_copy)["chat_template"]
    assert chat_template(model_copy, _config(model_copy)) == in_config
    (model_copy / "chat_template.json").write_text(json.dumps({"chat_template": LEGACY}))
    assert chat_template(model_copy, _config(model_copy)) == LEGACY
    (model_copy / "chat_template.jinja").write_text(JINJA)
    assert chat_template(model_copy, _config(model_copy)) == JINJA
    # transformers reads the same one (it knows .jinja and tokenizer_config.json)
    assert AutoTokenizer.from_pretrained(model_copy).chat_template == JINJA


def test_named_templates_join_the_default_as_a_list(model_copy):
    (model_copy / "chat_templates").mkdir()
    (model_copy / "chat_templates" / "tool_use.jinja").write_text(LEGACY)
    got = chat_template(model_copy, _config(model_copy))
    assert got == [{"name": "default", "template": _config(model_copy)["chat_template"]},
                   {"name": "tool_use", "template": LEGACY}]


def test_info_carries_the_template_found_in_chat_template_jinja(model_copy):
    _without_config_template(model_copy)
    (model_copy / "chat_template.jinja").write_text(JINJA)
    tokenizer = load_tokenizer(model_copy, load_model_config(model_copy))
    assert json.loads(tokenizer.tokenizer_config_json)["chat_template"] == JINJA


def chat_through_router(model_dir: Path) -> httpx.Response:
    """One chat request to a real router in front of a real shard serving ``model_dir``."""
    shard = start_shard(model_dir)
    router = start_router("--backend", f"m={shard.address}", "--no-redis")
    try:
        return httpx.post(router.url + "/v1/chat/completions", timeout=60, json={
            "model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]})
    finally:
        router.stop()
        shard.stop()


def test_a_model_with_only_chat_template_jinja_serves_chat(model_copy):
    (model_copy / "chat_template.jinja").write_text(_without_config_template(model_copy))
    r = chat_through_router(model_copy)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] >= 1


def test_a_model_without_any_template_says_where_it_looked(model_copy):
    _without_config_template(model_copy)
    r = chat_through_router(model_copy)
    assert r.status_code == 422, r.text
    assert "chat_template.jinja" in r.json()["error"]["message"]
