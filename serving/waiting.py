"""Polling until something holds: the one loop every wait of the stack uses (a Ray head that
comes up, Serve applications that become RUNNING, an engine that answers, a process that ends).

``check`` returns a truthy value when done (that value is returned) and a falsy one to keep
waiting; transient failures are the check's to swallow, and anything it raises ends the wait.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["poll", "wait_until"]

T = TypeVar("T")


def poll(check: Callable[[], T | None], timeout_s: float, interval_s: float) -> T | None:
    """``check()`` every ``interval_s`` until it returns a truthy value or ``timeout_s`` passes;
    its last value (falsy on time-out)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result or time.monotonic() >= deadline:
            return result
        time.sleep(interval_s)


def wait_until(check: Callable[[], T | None], timeout_s: float, interval_s: float, what: str) -> T:
    """Like :func:`poll`, but a time-out raises ``TimeoutError("<what> after <timeout_s>s")``."""
    result = poll(check, timeout_s, interval_s)
    if not result:
        raise TimeoutError(f"{what} after {timeout_s:.0f}s")
    return result
