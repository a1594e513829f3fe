"""The retry budget: how many requests the gateway may send again, so that a storm of replica
failures adds a bounded load instead of multiplying it. Pure; the clock is injected for tests."""

from __future__ import annotations

import time

__all__ = ["RetryBudget"]


class RetryBudget:
    """At most ``ratio`` retries per request over the last ``window_s`` seconds, plus
    ``min_retries`` per window that are always allowed (so a quiet gateway can still fail over).
    A storm of failures then adds at most ``ratio`` load instead of ``retries`` times it.
    """

    def __init__(self, ratio: float, min_retries: int, window_s: float = 10.0, buckets: int = 10) -> None:
        self.ratio, self.min_retries = ratio, min_retries
        self._width = window_s / buckets
        self._n = buckets
        self._requests: dict[int, int] = {}
        self._retries: dict[int, int] = {}

    def _totals(self, now: float) -> tuple[int, int]:
        cur = int(now // self._width)
        for d in (self._requests, self._retries):
            for b in [b for b in d if b <= cur - self._n]:
                del d[b]
        return sum(self._requests.values()), sum(self._retries.values())

    def request(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        b = int(now // self._width)
        self._requests[b] = self._requests.get(b, 0) + 1

    def try_retry(self, now: float | None = None) -> bool:
        """Spend one retry if the budget has one."""
        now = time.monotonic() if now is None else now
        requests, retries = self._totals(now)
        if retries >= self.min_retries + self.ratio * requests:
            return False
        b = int(now // self._width)
        self._retries[b] = self._retries.get(b, 0) + 1
        return True
