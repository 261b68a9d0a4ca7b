"""The live load of one model in this router instance, beyond its request counts.

``LoadTracker`` keeps what the autoscaler reads besides in-flight and queued requests
(those live in ``Admission`` and the ``Activator``):

- tokens in flight: for every request this router holds (queued or generating), its
  prompt tokens plus the new tokens it may still generate (``max_new_tokens`` minus
  those already streamed), the load a replica must carry that request counts miss;
- output tokens per second over the last ``window_s`` seconds;
- the wall-clock time of the last request (what scale-to-zero waits on).

Every change is a method call on the request path that costs an integer add; the rate
is computed only when a snapshot is taken (once a second by the publisher).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TokenLoad:
    tokens_in_flight: int
    tokens_per_second: float
    last_request_at: float  # epoch seconds; 0.0: no request yet


class LoadTracker:
    __slots__ = ("_reserved", "_generated", "_last_request_at", "_samples", "window_s")

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._reserved = 0          # tokens the requests in this router may still need
        self._generated = 0         # output tokens produced, ever (the rate's counter)
        self._last_request_at = 0.0
        self._samples: deque[tuple[float, int]] = deque()

    def arrived(self) -> None:
        """A request for the model arrived (cache hits and held requests included)."""
        self._last_request_at = time.time()

    def begin(self, tokens: int) -> None:
        """A request reserves its prompt plus its ``max_new_tokens``."""
        self._reserved += tokens

    def produced(self, count: int = 1) -> None:
        """``count`` output tokens reached the client (each frees one reserved token)."""
        self._reserved -= count
        self._generated += count

    def end(self, unused: int) -> None:
        """The request ended with ``unused`` of its reservation left (prompt included)."""
        self._reserved -= unused

    def snapshot(self, now: float | None = None) -> TokenLoad:
        """The current load; the rate is over the samples of the last ``window_s``."""
        now = time.monotonic() if now is None else now
        samples = self._samples
        if not samples or now - samples[-1][0] >= 0.5:
            samples.append((now, self._generated))
        while len(samples) > 2 and now - samples[1][0] >= self.window_s:
            samples.popleft()
        first_t, first_count = samples[0]
        span = now - first_t
        rate = (self._generated - first_count) / span if span > 0 else 0.0
        return TokenLoad(max(self._reserved, 0), round(rate, 3), self._last_request_at)
