"""Server-sent events as a client reads them."""

from __future__ import annotations

import json


def sse(text: str) -> list:
    """The ``data:`` payloads of an event stream: decoded JSON, or the literal ``[DONE]``."""
    events = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events
