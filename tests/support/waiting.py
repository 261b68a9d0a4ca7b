"""Polling a condition that another thread or process makes true."""

from __future__ import annotations

import time
from typing import Callable


def wait_for(predicate: Callable[[], object], timeout: float = 10.0) -> bool:
    """Polls ``predicate`` every 20 ms until it is true or ``timeout`` passes; returns its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return bool(predicate())
