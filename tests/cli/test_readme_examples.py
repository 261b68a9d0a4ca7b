"""Every request example in the README bounds its own length: a TGI body gives
``max_new_tokens`` and an OpenAI body ``max_tokens`` (their defaults run to the end of
the context), and each sends its JSON as JSON. tests/cli/test_serve.py runs the quick
start's examples against `make run`; the others need a cluster or static backends, so
their bodies are checked here."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
GENERATING = re.compile(r"/(generate|generate_stream|v1/completions|v1/chat/completions)\b")


def curl_commands(text: str) -> list[str]:
    """Each curl command of the README's code blocks, continuation lines joined."""
    commands = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.DOTALL):
        joined = re.sub(r"\\\n\s*", " ", block)
        commands += [line.strip() for line in joined.splitlines() if line.strip().startswith("curl ")]
    return commands


def test_every_generating_curl_example_limits_its_length_and_says_json():
    commands = [c for c in curl_commands(README.read_text()) if GENERATING.search(c)]
    assert len(commands) >= 4, commands  # the quick start's two, the cluster's, the router's
    for command in commands:
        words = shlex.split(command)
        assert "Content-Type: application/json" in words, command
        body = json.loads(words[words.index("-d") + 1])
        if "/v1/" in command:
            assert body.get("max_tokens", 0) > 0, command
        else:
            assert body.get("parameters", {}).get("max_new_tokens", 0) > 0, command


def test_no_curl_example_hides_outside_a_code_block():
    """Inline examples cannot be checked (or pasted) reliably: they live in blocks."""
    outside = re.sub(r"```.*?```", "", README.read_text(), flags=re.DOTALL)
    assert not re.search(r"`curl [^`]*" + GENERATING.pattern, outside)
