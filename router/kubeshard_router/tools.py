"""Tool calls: OpenAI's ``tools``/``tool_choice`` (and TGI's, which is the same route),
rendered through the model's chat template, enforced by the grammar, parsed back.

The model writes each call in its *format* (``tool_formats``: Hermes ``<tool_call>``,
Llama 3's JSON, Mistral's ``[TOOL_CALLS]``), picked per model from its chat template or
the router's ``--tool-call-parser``. A template that renders ``tools`` itself gets them;
for one that does not (the demo models', SmolLM2's), a system message lists them and
shows the format. The grammar is an xgrammar structural tag whose tags are the tools,
each call's arguments held to its JSON schema:

- ``auto``: free text, and every call the model opens is a valid call;
- ``required``: one or more calls and nothing else;
- a named function: exactly one call of that function;
- ``none``: no grammar, the text is the answer.

``ToolStream`` turns streamed text into content deltas and ``tool_calls`` delta items:
as OpenAI and vLLM stream them, a call's first item carries its id and name once the
model has written the name, and its arguments follow piece by piece as the model writes
them (their concatenation is the arguments' JSON text); TGI's older shape, and a call
that does not begin with its name, gets one item with the call whole once it is closed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from kubeshard_router.engine_request import GrammarRequest
from kubeshard_router.errors import ValidationFailed
from kubeshard_router.tool_formats import FORMATS, ToolFormat


@dataclass(frozen=True, slots=True)
class Function:
    name: str
    description: Optional[str]
    parameters: dict

    def as_tool(self) -> dict:
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(slots=True)
class ToolPlan:
    functions: list[Function]
    choice: str                 # auto | required | none | function
    function: Optional[str] = None  # the named function
    calls: list[dict] = field(default_factory=list)
    format: ToolFormat = FORMATS["hermes"]  # how the model writes a call (its tokenizer's)

    @property
    def parses(self) -> bool:
        return self.choice != "none"


def parse_tools(tools: Optional[list[Any]], tool_choice: Any) -> Optional[ToolPlan]:
    """Validates ``tools`` and ``tool_choice``; None when the request has no tools."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ValidationFailed("`tool_choice` needs `tools`", param="tool_choice")
        return None
    functions: list[Function] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
                or not isinstance(tool.get("function"), dict):
            raise ValidationFailed(f'`tools[{i}]` must be {{"type": "function", "function": {{"name": ...}}}}',
                                   param=f"tools[{i}]")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise ValidationFailed(f"`tools[{i}].function.name` must be 1 to 64 letters, digits, _ . or -",
                                   param=f"tools[{i}].function.name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ValidationFailed(f"`tools[{i}].function.parameters` must be a JSON schema (an object)",
                                   param=f"tools[{i}].function.parameters")
        if any(f.name == name for f in functions):
            raise ValidationFailed(f"`tools[{i}].function.name` {name!r} is given twice", param=f"tools[{i}]")
        functions.append(Function(name, fn.get("description"), params))
    if tool_choice is None or tool_choice == "auto":
        return ToolPlan(functions, "auto")
    if tool_choice in ("none", "required"):
        return ToolPlan(functions, tool_choice)
    name = None
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
    elif isinstance(tool_choice, str):
        name = tool_choice  # TGI: a function's name
    if not any(f.name == name for f in functions):
        raise ValidationFailed(f"`tool_choice` names no function in `tools`: {name!r}", param="tool_choice")
    return ToolPlan(functions, "function", name)


def template_renders_tools(source: Optional[str]) -> bool:
    return bool(source) and "tools" in source


def tool_system_prompt(functions: list[Function], fmt: ToolFormat) -> str:
    listed = "\n".join(json.dumps(f.as_tool()["function"]) for f in functions)
    return f"{fmt.instructions()}\nThe functions:\n{listed}"


def with_tool_prompt(messages: list[dict], functions: list[Function], fmt: ToolFormat) -> list[dict]:
    """The conversation with the tools described in its system message (for templates
    that do not render ``tools``)."""
    prompt = tool_system_prompt(functions, fmt)
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def call_text(fmt: ToolFormat, name: str, arguments: Any) -> str:
    """A call as the model writes it (for earlier assistant turns)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return fmt.call_text(name, arguments)


def tool_grammar(plan: ToolPlan) -> Optional[GrammarRequest]:
    if plan.choice == "none":
        return None
    fmt = plan.format
    tags = [fmt.tag(f.name, f.parameters) for f in plan.functions
            if plan.choice != "function" or f.name == plan.function]
    if plan.choice == "auto":
        body = {"type": "triggered_tags", "triggers": [fmt.trigger], "tags": tags}
    else:
        body = {"type": "tags_with_separator", "tags": tags, "separator": fmt.separator, "at_least_one": True}
        if plan.choice == "function":
            body["stop_after_first"] = True
    return GrammarRequest("structural_tag", json.dumps({"type": "structural_tag", "format": body}), "tools")


def _as_openai(call: dict, index: int, call_id: str) -> dict:
    return {"index": index, "id": f"{call_id}-{index}", "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}


def parse_calls(text: str, call_id: str, fmt: ToolFormat = FORMATS["hermes"]) -> tuple[Optional[str], list[dict]]:
    """(content, tool_calls) of a whole answer: the text outside the calls, or None."""
    stream = ToolStream(call_id, fmt)
    content, calls = stream.feed(text)
    rest, late = stream.finish()
    content, calls = content + rest, calls + late
    if not calls:
        return text, []
    return content.strip() or None, [{k: v for k, v in call.items() if k != "index"} for call in calls]


class _Arguments:
    """A streamed call's arguments (a JSON object or array) in the stream's buffer: where
    they start, how far they were sent, and where they end, found as their text comes
    by counting brackets outside strings (no JSON library parses a value in pieces)."""

    def __init__(self, start: int) -> None:
        self.sent = self.scanned = start
        self.depth = 0
        self.in_string = self.escaped = False
        self.end = -1  # just past the value, once it is whole

    def known(self, text: str) -> int:
        """How far ``text`` is the arguments' text: their end, or all of it before that."""
        i = self.scanned
        while self.end < 0 and i < len(text):
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = i + 1
            i += 1
        self.scanned = i
        return self.end if self.end >= 0 else i


class ToolStream:
    """Streamed text in, (content delta, ``tool_calls`` delta items) out; each item has its
    call's ``index``. ``incremental``: a call's arguments stream as they come (else each
    call comes whole, once closed: parse_calls, TGI's shape)."""

    def __init__(self, call_id: str, fmt: ToolFormat = FORMATS["hermes"], incremental: bool = False) -> None:
        self.call_id = call_id
        self.format = fmt
        self.incremental = incremental
        self.buffer = ""
        self.calls = 0  # calls closed
        self._open: Optional[_Arguments] = None  # the arguments of the call being streamed

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        self.buffer += text
        content, items = "", []
        while True:
            start = self.format.open_at(self.buffer)
            if start < 0:
                hold = 0 if final else self.format.held(self.buffer)  # could begin an opening
                cut = len(self.buffer) - hold
                content += self.buffer[:cut]
                self.buffer = self.buffer[cut:]
                return content, items
            content += self.buffer[:start]
            self.buffer = self.buffer[start:]
            taken = self.format.take(self.buffer, final)
            if taken is None:  # the call is not closed yet
                if self.incremental:
                    items += self._stream(self.buffer)
                return content, items
            found, used = taken
            streamed = self._open is not None
            if streamed:
                items += self._stream(self.buffer[:used])  # the rest of its arguments
                self._open = None
                if found:  # it is the first of them, sent already
                    self.calls += 1
                    found = found[1:]
            for call in found:
                items.append(_as_openai(call, self.calls, self.call_id))
                self.calls += 1
            if not found and not streamed:  # not a call after all: it stays text
                content += self.buffer[:used]
            self.buffer = self.buffer[used:]

    def _stream(self, text: str) -> list[dict]:
        """The items of the open call in ``text`` (which starts at its opening) not sent yet."""
        items = []
        index = self.calls
        if self._open is None:
            head = self.format.streamed_head(text)
            if head is None or head[1] >= len(text) or text[head[1]] not in "{[":
                return []  # not yet (or not a call that begins with its name: it goes whole)
            name, start = head
            self._open = _Arguments(start)
            items.append({"index": index, "id": f"{self.call_id}-{index}", "type": "function",
                          "function": {"name": name, "arguments": ""}})
        args = self._open
        known = args.known(text)
        if known > args.sent:
            piece, args.sent = text[args.sent:known], known
            if items:
                items[0]["function"]["arguments"] = piece
            else:
                items.append({"index": index, "function": {"arguments": piece}})
        return items

    def finish(self) -> tuple[str, list[dict]]:
        """What is still held once the answer ended: a call that never closed is text
        (unless part of it was streamed as a call: its arguments stay cut short)."""
        content, items = self.feed("", final=True)
        rest = content if self._open is not None else content + self.buffer
        self.buffer, self._open = "", None
        return rest, items
