"""Tool calls: OpenAI's ``tools``/``tool_choice`` (and TGI's, which is the same route),
rendered through the model's chat template, enforced by the grammar, parsed back.

The model writes each call as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
(the Hermes format that Qwen2.5, Hermes and many other templates use). A template that
renders ``tools`` itself gets them; for one that does not (the demo models', SmolLM2's),
a system message lists them and shows that format. The grammar is an xgrammar
structural tag whose tags are the tools, each call's arguments held to its JSON schema:

- ``auto``: free text, and every ``<tool_call>`` the model opens is a valid call;
- ``required``: one or more calls and nothing else;
- a named function: exactly one call of that function;
- ``none``: no grammar, the text is the answer.

``ToolStream`` turns streamed text into content deltas and, once a call is closed, one
``tool_calls`` delta carrying the call whole (name and arguments).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from kubeshard_router.engine_request import GrammarRequest
from kubeshard_router.errors import ValidationFailed

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)

TOOL_PROMPT = (
    "You can call functions (tools) to answer. To call one, reply with\n"
    f"{OPEN}\n{{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}}\n{CLOSE}\n"
    "once per call. The functions:\n{tools}"
)


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


def tool_system_prompt(functions: list[Function]) -> str:
    return TOOL_PROMPT.replace("{tools}", "\n".join(json.dumps(f.as_tool()["function"]) for f in functions))


def with_tool_prompt(messages: list[dict], functions: list[Function]) -> list[dict]:
    """The conversation with the tools described in its system message (for templates
    that do not render ``tools``)."""
    prompt = tool_system_prompt(functions)
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def call_text(name: str, arguments: Any) -> str:
    """A call as the model writes it (for earlier assistant turns)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CLOSE}"


def _tag(f: Function) -> dict:
    return {"type": "tag", "begin": f'{OPEN}\n{{"name": {json.dumps(f.name)}, "arguments": ',
            "content": {"type": "json_schema", "json_schema": f.parameters}, "end": f"}}\n{CLOSE}"}


def tool_grammar(plan: ToolPlan) -> Optional[GrammarRequest]:
    if plan.choice == "none":
        return None
    if plan.choice == "auto":
        fmt = {"type": "triggered_tags", "triggers": [OPEN], "tags": [_tag(f) for f in plan.functions]}
    elif plan.choice == "required":
        fmt = {"type": "tags_with_separator", "tags": [_tag(f) for f in plan.functions], "separator": "\n",
               "at_least_one": True}
    else:
        fmt = {"type": "tags_with_separator", "separator": "\n", "at_least_one": True, "stop_after_first": True,
               "tags": [_tag(f) for f in plan.functions if f.name == plan.function]}
    return GrammarRequest("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}), "tools")


def _call(body: str, index: int, call_id: str) -> Optional[dict]:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return {"id": f"{call_id}-{index}", "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(arguments)}}


def parse_calls(text: str, call_id: str) -> tuple[Optional[str], list[dict]]:
    """(content, tool_calls) of a whole answer: the text outside the calls, or None."""
    calls = []
    for m in _CALL.finditer(text):
        call = _call(m.group(1), len(calls), call_id)
        if call is not None:
            calls.append(call)
    if not calls:
        return text, []
    content = _CALL.sub("", text).strip()
    return content or None, calls


class ToolStream:
    """Streamed text in, (content delta, finished calls) out."""

    def __init__(self, call_id: str) -> None:
        self.call_id = call_id
        self.buffer = ""
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buffer += text
        content, calls = "", []
        while True:
            start = self.buffer.find(OPEN)
            if start < 0:
                # hold back a tail that could be the start of "<tool_call>"
                hold = next((k for k in range(min(len(OPEN) - 1, len(self.buffer)), 0, -1)
                             if OPEN.startswith(self.buffer[-k:])), 0)
                cut = len(self.buffer) - hold
                content += self.buffer[:cut]
                self.buffer = self.buffer[cut:]
                return content, calls
            content += self.buffer[:start]
            self.buffer = self.buffer[start:]
            end = self.buffer.find(CLOSE)
            if end < 0:
                return content, calls
            call = _call(self.buffer[len(OPEN):end].strip(), self.calls, self.call_id)
            if call is not None:
                calls.append(call)
                self.calls += 1
            else:
                content += self.buffer[:end + len(CLOSE)]
            self.buffer = self.buffer[end + len(CLOSE):]

    def finish(self) -> str:
        rest, self.buffer = self.buffer, ""
        return rest
