"""How a model writes a tool call: the formats of vLLM's ``--tool-call-parser`` that
kubeshard speaks, each with what the grammar forces, what the parser reads back and how
an earlier call is shown to the model again.

- ``hermes`` (Qwen2.5, Hermes, and the tool prompt kubeshard adds for templates that do
  not render tools): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
- ``llama3_json`` (Llama 3.1-3.3's JSON tool calling): ``{"name": ..., "parameters": {...}}``,
  optionally after ``<|python_tag|>``, several calls joined by ``; ``;
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.

The format of a model is picked once, when its tokenizer is built: from the router's
``--tool-call-parser``, or (``auto``) from the markers its chat template mentions, and
``hermes`` when it mentions none. ``markers`` are the special tokens a format's calls may
start with: their text is kept for the parser even when special tokens are skipped.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

_DECODER = json.JSONDecoder()
_SEPARATOR = re.compile(r"\s*;\s*")
# a call's JSON up to its arguments' value: its name (a JSON string) comes first, as each
# format's grammar writes it
_NAME_THEN_ARGUMENTS = r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*'


def _object(text: str, start: int) -> Optional[tuple[Any, int]]:
    """The JSON value at ``start`` (after whitespace) and where it ends, or None when the
    text there is not (yet) a whole JSON value."""
    start = len(text) - len(text[start:].lstrip())
    try:
        return _DECODER.raw_decode(text, start)
    except json.JSONDecodeError:
        return None


class ToolFormat:
    name = ""
    trigger = ""              # what opens a call (auto's trigger, the stream's marker)
    separator = "\n"          # between calls, for required / named
    markers: frozenset[str] = frozenset()
    key = "arguments"         # the arguments' key in a call's JSON
    head: Optional[re.Pattern] = None  # from an opening to its call's arguments (streamed_head)

    def open_at(self, text: str) -> int:
        """Where the first call may begin in ``text`` (-1: nowhere)."""
        return text.find(self.trigger)

    def held(self, text: str) -> int:
        """How many trailing characters could be the start of an opening (held back)."""
        openers = [self.trigger, *self.markers]
        return max((k for o in openers for k in range(min(len(o) - 1, len(text)), 0, -1)
                    if o.startswith(text[-k:])), default=0)

    def take(self, text: str, final: bool) -> Optional[tuple[list[dict], int]]:
        """``text`` starts at an opening: the calls there ({"name", "arguments"}; none when
        malformed) and the characters they used, or None while the text is incomplete."""
        raise NotImplementedError

    def streamed_head(self, text: str) -> Optional[tuple[str, int]]:
        """``text`` starts at an opening: the name of the call there and where its
        arguments begin, once the text has come that far (the arguments streamed piece by
        piece start there); None before that, or when the call does not begin with its
        name (it is then sent whole, once closed)."""
        m = self.head.match(text) if self.head is not None else None
        if m is None:
            return None
        try:
            return json.loads(m.group(1)), m.end()
        except json.JSONDecodeError:
            return None

    def begin(self, name: str) -> str:
        raise NotImplementedError

    def end(self) -> str:
        raise NotImplementedError

    def call_text(self, name: str, arguments: Any) -> str:
        raise NotImplementedError

    def instructions(self) -> str:
        raise NotImplementedError

    def tag(self, name: str, parameters: dict) -> dict:
        """The structural tag of one function's call (xgrammar)."""
        return {"type": "tag", "begin": self.begin(name), "content": {"type": "json_schema",
                                                                      "json_schema": parameters},
                "end": self.end()}

    def _call(self, value: Any) -> Optional[dict]:
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get(self.key, value.get("arguments", value.get("parameters", {})))
        return {"name": value["name"], "arguments": arguments}


class Hermes(ToolFormat):
    name, trigger, close = "hermes", "<tool_call>", "</tool_call>"
    head = re.compile(r"<tool_call>\s*" + _NAME_THEN_ARGUMENTS)

    def take(self, text, final):
        end = text.find(self.close)
        if end < 0:
            return None
        found = _object(text, len(self.trigger))
        call = self._call(found[0]) if found is not None else None
        return ([call] if call is not None else []), end + len(self.close)

    def begin(self, name):
        return f'{self.trigger}\n{{"name": {json.dumps(name)}, "arguments": '

    def end(self):
        return f"}}\n{self.close}"

    def call_text(self, name, arguments):
        return f"{self.trigger}\n{json.dumps({'name': name, 'arguments': arguments})}\n{self.close}"

    def instructions(self):
        return ("You can call functions (tools) to answer. To call one, reply with\n"
                f"{self.trigger}\n{{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}}\n"
                f"{self.close}\nonce per call.")


class Llama3Json(ToolFormat):
    name, trigger, separator, key = "llama3_json", '{"name": ', "; ", "parameters"
    markers = frozenset({"<|python_tag|>"})
    _open = re.compile(r'<\|python_tag\|>|\{\s*"name"\s*:')
    head = re.compile(r"(?:<\|python_tag\|>)?\s*" + _NAME_THEN_ARGUMENTS)

    def open_at(self, text):
        m = self._open.search(text)
        return m.start() if m else -1

    def take(self, text, final):
        start = len("<|python_tag|>") if text.startswith("<|python_tag|>") else 0
        found = _object(text, start)
        if found is None:
            return ([], len(text)) if final else None
        call = self._call(found[0])
        sep = _SEPARATOR.match(text, found[1])  # "; " before the next call
        return ([call] if call is not None else []), sep.end() if sep else found[1]

    def _call(self, value):  # a JSON answer with a "name" is not a call without its arguments
        if isinstance(value, dict) and ("parameters" in value or "arguments" in value):
            return super()._call(value)
        return None

    def begin(self, name):
        return f'{self.trigger}{json.dumps(name)}, "parameters": '

    def end(self):
        return "}"

    def call_text(self, name, arguments):
        return json.dumps({"name": name, "parameters": arguments})

    def instructions(self):
        return ('You can call functions (tools) to answer. To call one, reply with a JSON object\n'
                '{"name": <function name>, "parameters": <arguments as a JSON object>}\n'
                'and nothing else; join several calls with "; ".')


class Mistral(ToolFormat):
    name, trigger, separator = "mistral", "[TOOL_CALLS]", ""
    markers = frozenset({"[TOOL_CALLS]"})
    head = re.compile(r"\[TOOL_CALLS\]\s*\[\s*" + _NAME_THEN_ARGUMENTS)  # the array's first call

    def take(self, text, final):
        found = _object(text, len(self.trigger))
        if found is None:
            return ([], len(text)) if final else None
        values = found[0] if isinstance(found[0], list) else [found[0]]
        calls = [c for c in (self._call(v) for v in values) if c is not None]
        return calls, found[1]

    def begin(self, name):
        return f'{self.trigger}[{{"name": {json.dumps(name)}, "arguments": '

    def end(self):
        return "}]"

    def call_text(self, name, arguments):
        return self.trigger + json.dumps([{"name": name, "arguments": arguments}])

    def instructions(self):
        return ("You can call functions (tools) to answer. To call them, reply with\n"
                f'{self.trigger}[{{"name": <function name>, "arguments": <arguments as a JSON object>}}, ...]')


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (Hermes(), Llama3Json(), Mistral())}
PARSERS = ("auto", *FORMATS)


def detect(template_source: str) -> ToolFormat:
    """The format a chat template asks for, by the markers it mentions (hermes otherwise)."""
    if "[TOOL_CALLS]" in template_source:
        return FORMATS["mistral"]
    if "<tool_call>" in template_source:
        return FORMATS["hermes"]
    if "<|python_tag|>" in template_source:  # Llama 3.1-3.3 (their templates name it for tool calls)
        return FORMATS["llama3_json"]
    return FORMATS["hermes"]


def choose(parser: str, template_source: str) -> ToolFormat:
    """``--tool-call-parser``: a format's name, or ``auto`` (read from the template)."""
    if parser == "auto":
        return detect(template_source)
    if parser not in FORMATS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)}, got {parser!r}")
    return FORMATS[parser]
