"""HTTP requests made from a background thread, while the test does something else."""

from __future__ import annotations

import threading

import httpx


def post_in_thread(url: str, body: dict, out: list) -> threading.Thread:
    """POSTs ``body`` as JSON from a new thread; appends (status, text, headers) to ``out``."""
    def run() -> None:
        with httpx.Client(timeout=60) as c:
            r = c.post(url, json=body)
            out.append((r.status_code, r.text, dict(r.headers)))
    t = threading.Thread(target=run)
    t.start()
    return t
