"""Server-sent events as a client reads them: a whole body, or line by line as they arrive."""

from __future__ import annotations

import json
from typing import Any, Iterable, Iterator

DONE = "[DONE]"


def sse_data(line: str) -> Any:
    """The payload of one ``data:`` line (or block): decoded JSON, or the literal
    ``[DONE]``; None for a line that carries no data (blank, ``event:``, a comment)."""
    if not line.startswith("data:"):
        return None
    data = line[len("data:"):].strip()
    return data if data == DONE else json.loads(data)


def sse_events(lines: Iterable[str]) -> Iterator[Any]:
    """The payloads of a stream read line by line (``httpx``'s ``iter_lines``), each as
    it arrives."""
    for line in lines:
        event = sse_data(line)
        if event is not None:
            yield event


def sse(text: str) -> list:
    """The ``data:`` payloads of a whole event-stream body."""
    return list(sse_events(text.split("\n\n")))
