"""Tool-call formats (router/kubeshard_router/tool_formats.py): Hermes ``<tool_call>``,
Llama 3's JSON and Mistral's ``[TOOL_CALLS]`` are parsed whole and streamed, picked from
the chat template or --tool-call-parser, and used when the chat template renders the
tools itself: the prompt is the template's own rendering (no added tool prompt), the
grammar forces the model's format, and the `openai` client gets valid tool_calls from a
real engine serving the demo model under each template."""

from __future__ import annotations

import json
import shutil

import jsonschema
import openai
import pytest

from kubeshard_router.openai_schema import ChatCompletionRequest, plan_chat
from kubeshard_router.tokenization import ModelTokenizer
from kubeshard_router.tool_formats import FORMATS, choose, detect
from kubeshard_router.tools import ToolStream, parse_calls
from kubeshard_router.validation import Limits
from tests.support.servers import start_serve

NO_CACHE = {"Cache-Control": "no-cache"}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Time in a timezone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}},
                   "required": ["zone"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}

# Chat templates that render `tools` themselves, in the style of each model family.
TEMPLATES = {
    "hermes": (  # Qwen2.5 / Hermes
        "{%- if tools %}<|im_start|>system\nYou may call one or more functions to assist with the user query.\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
        "{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
        "<args-json-object>}\n</tool_call><|im_end|>\n{% endif %}"
        "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
        "{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "llama3_json": (  # Llama 3.1: tools in the first user message
        "{{- bos_token }}{%- if tools is not none %}<|start_header_id|>system<|end_header_id|>\n\n"
        "Environment: ipython<|eot_id|>{% endif %}"
        "{%- for message in messages %}"
        "{%- if message.role == 'user' and loop.first and tools is not none %}"
        "<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please respond with a JSON "
        "for a function call with its proper arguments that best answers the given prompt.\n\nRespond in the "
        "format {\"name\": function name, \"parameters\": dictionary of argument name and its value}. Do not use "
        "variables.\n\n{% for t in tools %}{{ t | tojson }}\n\n{% endfor %}{{ message.content }}<|eot_id|>"
        "{%- elif message.role == 'assistant' and message.tool_calls is defined %}"
        "<|start_header_id|>assistant<|end_header_id|>\n\n{% for c in message.tool_calls %}<|python_tag|>"
        "{\"name\": \"{{ c.function.name }}\", \"parameters\": {{ c.function.arguments | tojson }}}{% endfor %}"
        "<|eom_id|>"
        "{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n{{ message.content }}<|eot_id|>"
        "{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"),
    "mistral": (
        "{{ bos_token }}{% for message in messages %}{% if message.role == 'user' %}"
        "{% if loop.last and tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
        "[INST] {{ message.content }}[/INST]"
        "{% elif message.tool_calls is defined %}[TOOL_CALLS]{{ message.tool_calls | tojson }}{{ eos_token }}"
        "{% else %}{{ message.content }}{{ eos_token }}{% endif %}{% endfor %}"),
}


@pytest.mark.parametrize("name,text,content", [
    ("hermes", 'Sure.<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}\n</tool_call>',
     "Sure."),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; '
                    '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "c"}}', None),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}, '
                '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}]', None),
])
def test_each_format_parses_whole_and_streamed(name, text, content):
    fmt = FORMATS[name]
    want = [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Rome", "unit": "c"})]
    got_content, calls = parse_calls(text, "call", fmt)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == want
    assert [c["id"] for c in calls] == ["call-0", "call-1"]
    for incremental in (False, True):
        stream = ToolStream("call", fmt, incremental=incremental)  # three characters at a time
        streamed_text, items = "", []
        for i in range(0, len(text), 3):
            piece, more = stream.feed(text[i:i + 3])
            streamed_text, items = streamed_text + piece, items + more
        rest, late = stream.finish()
        items += late
        assert (streamed_text + rest).strip() == (content or "")
        assert stream.calls == 2
        calls = {}  # as the openai client adds the items up
        for item in items:
            call = calls.setdefault(item["index"], {"id": item.get("id"), "name": "", "arguments": ""})
            call["name"] += item.get("function", {}).get("name") or ""
            call["arguments"] += item["function"]["arguments"]
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == want
        assert [c["id"] for c in calls.values()] == ["call-0", "call-1"]
        per_call = [sum(1 for item in items if item["index"] == k) for k in (0, 1)]
        if not incremental:
            assert per_call == [1, 1]  # each call whole, once closed
        else:  # each call's arguments in pieces (mistral's second call comes whole, with the array)
            assert per_call[0] > 2
            assert per_call[1] == 1 if name == "mistral" else per_call[1] > 2
            assert "id" in items[0] and all("id" not in item for item in items[1:per_call[0]])


def test_arguments_stream_as_the_model_writes_them():
    """Token by token: each piece of a call's arguments goes out as it comes (brackets in
    strings do not end them), and a call cut short by the token limit keeps what was sent
    while the rest of the answer's text stays content."""
    stream = ToolStream("c", FORMATS["hermes"], incremental=True)
    pieces = ["Let me look.", "<tool", "_call>\n", '{"name": "get', '_weather", "arguments": ',
              '{"city": "Ro', 'me }{\\"', '", "unit": ', '"c"}', "}\n</tool_call>"]
    out = [stream.feed(p) for p in pieces]
    assert [text for text, _ in out][0] == "Let me look."
    args = [item["function"]["arguments"] for _, items in out for item in items]
    assert args == ["{\"city\": \"Ro", 'me }{\\"', '", "unit": ', '"c"}']
    assert json.loads("".join(args)) == {"city": 'Rome }{"', "unit": "c"}  # an escaped quote
    assert [item.get("id") for _, items in out for item in items][0] == "c-0"
    assert stream.calls == 1
    cut = ToolStream("c", FORMATS["hermes"], incremental=True)
    _, items = cut.feed('<tool_call>\n{"name": "get_time", "arguments": {"zone": "U')
    rest, late = cut.finish()
    assert (rest, late, cut.calls) == ("", [], 0)
    assert [i["function"]["arguments"] for i in items] == ['{"zone": "U']


def test_text_that_is_not_a_call_stays_text():
    plain = 'The answer is {"name": "Bob", "age": 3}; no call. <tool_call>oops</tool_call>'
    assert parse_calls(plain, "c", FORMATS["llama3_json"]) == (plain, [])
    assert parse_calls(plain, "c", FORMATS["hermes"]) == (plain, [])
    unclosed = '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": '
    assert parse_calls(unclosed, "c", FORMATS["mistral"]) == (unclosed, [])


def test_the_format_comes_from_the_template_or_the_flag():
    assert {name: detect(source).name for name, source in TEMPLATES.items()} == {n: n for n in TEMPLATES}
    assert detect("{{ messages }}").name == "hermes" and detect("").name == "hermes"
    assert choose("mistral", TEMPLATES["hermes"]).name == "mistral"
    assert choose("auto", TEMPLATES["llama3_json"]).name == "llama3_json"
    with pytest.raises(ValueError, match="tool_call_parser must be one of auto, hermes, llama3_json, mistral"):
        choose("pythonic", "")


def _tokenizer(folder, template: str, parser: str = "auto") -> ModelTokenizer:
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    return ModelTokenizer((folder / "tokenizer.json").read_bytes(), json.dumps(config).encode(), parser)


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_a_template_that_renders_tools_gets_them_and_the_grammar_forces_its_format(demo_model, name):
    tokenizer = _tokenizer(demo_model(), TEMPLATES[name])
    limits = Limits(max_input_tokens=4000, max_total_tokens=4096, vocab_size=tokenizer.vocab_size)
    req = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "Weather in Rome?"}], "tools": [WEATHER, TIME],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    plan = plan_chat(req, tokenizer, limits)
    assert plan.tools.format.name == name
    # the prompt is the template's own rendering of the tools, nothing added
    assert plan.prompt_text == tokenizer.apply_chat_template([{"role": "user", "content": "Weather in Rome?"}],
                                                             tools=[f.as_tool() for f in plan.tools.functions])
    assert '"get_weather"' in plan.prompt_text and "You can call functions" not in plan.prompt_text
    grammar = json.loads(plan.engine.grammar.value)["format"]
    [tag] = grammar["tags"]
    assert tag["begin"] == FORMATS[name].begin("get_weather") and grammar["stop_after_first"]
    assert tag["content"]["json_schema"] == SCHEMAS["get_weather"]
    assert plan.special_kept == FORMATS[name].markers
    # a template that renders no tools gets the format's instructions in a system message
    plain = _tokenizer(demo_model(), "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}", name)
    plan = plan_chat(req, plain, limits)
    assert FORMATS[name].instructions() in plan.prompt_text and '"get_weather"' in plan.prompt_text


@pytest.fixture(scope="module", params=list(TEMPLATES))
def served(request, demo_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"tools-{request.param}") / "model"
    shutil.copytree(demo_model(), folder)
    (folder / "chat_template.jinja").write_text(TEMPLATES[request.param])
    proc = start_serve(folder, "--num-threads", "1", "--kv-cache-memory", "64MiB", "--max-input-tokens", "1024",
                       "--max-total-tokens", "1536")
    client = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", default_headers=NO_CACHE)
    yield request.param, client, client.models.list().data[0].id
    proc.stop()


def _valid(call) -> tuple[str, dict]:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return call.function.name, arguments


def test_the_openai_client_gets_valid_calls_in_each_models_format(served):
    name, client, model = served
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    required = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER, TIME],
                                              tool_choice="required", max_tokens=200, temperature=0)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, (name, choice.message)
    calls = [_valid(c) for c in choice.message.tool_calls]
    named = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER, TIME],
                                           tool_choice={"type": "function", "function": {"name": "get_time"}},
                                           max_tokens=80, temperature=0)
    [call] = named.choices[0].message.tool_calls
    assert _valid(call)[0] == "get_time" and named.choices[0].message.content is None
    stream = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER, TIME],
                                            tool_choice="required", max_tokens=200, temperature=0, stream=True)
    deltas: dict[int, dict] = {}
    for chunk in stream:
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                entry = deltas.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
    assert [(d["name"], json.loads(d["arguments"])) for d in deltas.values()] == calls
    follow = client.chat.completions.create(model=model, max_tokens=8, temperature=0, tools=[WEATHER, TIME],
                                            messages=messages + [choice.message.model_dump(exclude_none=True),
                                                                 {"role": "tool", "tool_call_id": call.id,
                                                                  "content": "sunny, 21 C"}])
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
