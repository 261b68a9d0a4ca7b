"""wait_for: poll a condition with a deadline, and say what was last seen when it fails."""

from __future__ import annotations

import time
import traceback
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_for(fn: Callable[[], T], timeout: float, interval: float = 0.5, what: str = "condition") -> T:
    """Call `fn` until it returns a truthy value, and return that value.

    Exceptions raised by `fn` count as "not yet". After `timeout` seconds, raises an
    AssertionError naming `what`, with the last value returned or exception raised.
    """
    deadline = time.monotonic() + timeout
    last: str = "fn was never called"
    while True:
        try:
            value = fn()
            if value:
                return value
            last = f"last value: {value!r}"
        except Exception as e:  # the condition may not be checkable yet (404, refused)
            last = "last exception: " + "".join(traceback.format_exception_only(type(e), e)).strip()
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}; {last[:4000]}")
        time.sleep(min(interval, max(0.0, deadline - time.monotonic())))
