"""The model's tokenizer and chat template, built once per model from the leader's Info.

The chat template is rendered the way transformers' ``apply_chat_template`` renders it:
a sandboxed Jinja environment with ``trim_blocks``/``lstrip_blocks``, ``raise_exception``,
``strftime_now``, a non-escaping ``tojson`` and the tokenizer's special tokens as
variables; the rendered text is tokenized without adding special tokens again.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any, Optional

import jinja2
import jinja2.ext
import orjson
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from kubeshard_router.tool_formats import ToolFormat, choose as choose_tool_format

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template refused the conversation (``raise_exception``) or failed to render."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body (transformers tracks it)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _token_content(value: Any) -> Optional[str]:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]  # a serialized AddedToken
    return None


def _pick_template(raw: Any) -> Optional[str]:
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list):  # named templates: [{"name": "default", "template": "..."}]
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return None


class ModelTokenizer:
    def __init__(self, tokenizer_json: bytes, tokenizer_config_json: bytes = b"",
                 tool_call_parser: str = "auto") -> None:
        if not tokenizer_json:
            raise ValueError("tokenizer_json is empty: the leader's Info carries no tokenizer")
        self._tokenizer = Tokenizer.from_str(tokenizer_json.decode("utf-8"))
        config = orjson.loads(tokenizer_config_json) if tokenizer_config_json else {}
        if not isinstance(config, dict):
            config = {}
        self.special_tokens: dict[str, Any] = {}
        for name in SPECIAL_TOKEN_NAMES:
            content = _token_content(config.get(name))
            if content is not None:
                self.special_tokens[name] = content
        extra = config.get("additional_special_tokens")
        if isinstance(extra, list):
            self.special_tokens["additional_special_tokens"] = [
                c for c in (_token_content(t) for t in extra) if c is not None]
        source = _pick_template(config.get("chat_template"))
        self._template: Optional[jinja2.Template] = None
        self.template_source: str = source or ""
        # how this model writes tool calls (the router's --tool-call-parser, or its template's)
        self.tool_format: ToolFormat = choose_tool_format(tool_call_parser, self.template_source)
        if source:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True,
                extensions=[_GenerationTag, jinja2.ext.loopcontrols])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            self._template = env.from_string(source)

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids of the tokenizer's special added tokens (EOS, BOS, chat markers), as the shard
        server's tokenizer marks them."""
        return frozenset(i for i, t in self._tokenizer.get_added_tokens_decoder().items() if t.special)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_spans(self, text: str, add_special_tokens: bool = True) -> list[tuple[int, int, int]]:
        """Each token of ``text`` as (id, start, stop): the characters of ``text`` it
        stands for (an added special token, such as BOS, stands for none)."""
        encoding = self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return [(i, start, stop) for i, (start, stop) in zip(encoding.ids, encoding.offsets)]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> Optional[str]:
        return self._tokenizer.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: Optional[list[dict[str, Any]]] = None) -> str:
        if self._template is None:
            raise ChatTemplateError("the model has no chat_template (none in its chat_template.jinja, "
                                    "chat_template.json or tokenizer_config.json): use /v1/completions")
        try:
            return self._template.render(messages=messages, tools=tools, documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"chat template: {exc}") from exc
        except Exception as exc:  # a template bug (TypeError, ...) is still the request's fault
            raise ChatTemplateError(f"chat template failed on these messages: {exc}") from exc
