"""The model's tokenizer, its special tokens and end-of-sequence ids, checked against the model."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from kubeshard_shard.models.config import CheckpointError, ModelConfig


@dataclass
class ModelTokenizer:
    tokenizer: Tokenizer
    special_ids: frozenset[int]
    eos_ids: frozenset[int]
    tokenizer_json: bytes
    tokenizer_config_json: bytes

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """A token decoded on its own, special tokens included (for alternatives)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
    return data if isinstance(data, dict) else {}


def load_tokenizer(model_dir: Path, config: ModelConfig) -> ModelTokenizer:
    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir}: no tokenizer.json (a fast Hugging Face tokenizer is required)")
    raw = path.read_bytes()
    try:
        tokenizer = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as exc:  # tokenizers raises a plain Exception subclass
        raise CheckpointError(f"{path}: cannot load tokenizer ({exc})") from exc

    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab > config.vocab_size:
        raise CheckpointError(
            f"{path}: the tokenizer has {vocab} tokens but the model's vocab_size is {config.vocab_size}; "
            "the tokenizer does not belong to this model")

    special = frozenset(i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special)
    tok_config = _read_json(model_dir / "tokenizer_config.json")
    gen_config = _read_json(model_dir / "generation_config.json")

    eos: set[int] = set(config.eos_token_ids)
    gen_eos = gen_config.get("eos_token_id")
    if isinstance(gen_eos, int):
        eos.add(gen_eos)
    elif isinstance(gen_eos, list):
        eos.update(int(x) for x in gen_eos)
    eos_token = tok_config.get("eos_token")
    if isinstance(eos_token, dict):
        eos_token = eos_token.get("content")
    if isinstance(eos_token, str) and tokenizer.token_to_id(eos_token) is not None:
        eos.add(tokenizer.token_to_id(eos_token))
    bad = sorted(i for i in eos if i >= config.vocab_size)
    if bad:
        raise CheckpointError(f"{model_dir}: end-of-sequence ids {bad} are outside the model's vocabulary "
                              f"({config.vocab_size}); the tokenizer does not match the model")
    template = chat_template(model_dir, tok_config)
    if template is not None:
        tok_config = {**tok_config, "chat_template": template}
    return ModelTokenizer(
        tokenizer=tokenizer,
        special_ids=special,
        eos_ids=frozenset(eos),
        tokenizer_json=raw,
        tokenizer_config_json=json.dumps(tok_config).encode(),
    )


def chat_template(model_dir: Path, tok_config: dict) -> str | list | None:
    """The model's chat template, from wherever the checkpoint keeps it, in transformers'
    order of precedence: ``chat_template.jinja`` (what transformers saves today), the
    legacy ``chat_template.json`` (``{"chat_template": ...}``), then the entry in
    ``tokenizer_config.json`` (where a converted GGUF file's template lands too). Named
    templates in ``chat_templates/*.jinja`` join the default one as transformers' list
    form ``[{"name", "template"}]``."""
    default: str | list | None = None
    jinja, legacy = model_dir / "chat_template.jinja", model_dir / "chat_template.json"
    if jinja.is_file():
        default = jinja.read_text(encoding="utf-8")
    elif legacy.is_file():
        default = _read_json(legacy).get("chat_template")
    else:
        default = tok_config.get("chat_template")
    folder = model_dir / "chat_templates"
    named = {p.stem: p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.jinja"))} if folder.is_dir() else {}
    if not named:
        return default
    if isinstance(default, list):  # already named templates: ours join them
        named = {**{t.get("name"): t.get("template") for t in default if isinstance(t, dict)}, **named}
    elif default is not None:
        named = {"default": default, **named}
    return [{"name": name, "template": text} for name, text in named.items()]
