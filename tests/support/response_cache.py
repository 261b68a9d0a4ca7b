"""The router's response cache as a client sees it."""

from __future__ import annotations

import httpx

from tests.support.sse import sse


def assert_repeat_is_cached(url: str, body: dict, timeout: float) -> httpx.Response:
    """POSTs ``body`` to ``/generate`` twice: the first answer is a cache miss, the second
    a hit with the same JSON, and ``/generate_stream`` replays that answer. Returns the
    first response."""
    first = httpx.post(url + "/generate", json=body, timeout=timeout)
    second = httpx.post(url + "/generate", json=body, timeout=timeout)
    assert first.status_code == second.status_code == 200
    assert first.headers["x-kubeshard-cache"] == "miss" and second.headers["x-kubeshard-cache"] == "hit"
    assert first.json() == second.json()
    replay = sse(httpx.post(url + "/generate_stream", json=body, timeout=timeout).text)
    assert replay[-1]["generated_text"] == first.json()["generated_text"]
    return first
