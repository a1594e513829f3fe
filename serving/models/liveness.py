"""Is the engine making progress? vLLM's ``/health`` only says whether the engine has errored: it
passes while the EngineCore process is stopped or stuck, and requests then wait for the upstream
timeout. The replica therefore watches the engine's own counters (from ``/metrics``): an engine
that holds requests (running or waiting) while neither its generated nor its prompt-token count
moves for ``stall_s`` is hung. Prompt tokens count as progress so that a long prefill on a slow
CPU is not mistaken for a hang.

Only consecutive good scrapes are evidence: a failed scrape, or scrapes further apart than
``max_gap_s`` (the API server itself was slow or stopped, so its counters lag), start the
period again.
"""

from __future__ import annotations

__all__ = ["PROGRESS_COUNTERS", "StallWatch"]

PROGRESS_COUNTERS = ("vllm:generation_tokens_total", "vllm:prompt_tokens_total")
LOAD_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")


class StallWatch:
    """Feed it every scrape of the engine's metrics; it says when the engine has had work and made
    no progress for ``stall_s``."""

    def __init__(self, stall_s: float, max_gap_s: float = 3.0) -> None:
        self.stall_s, self.max_gap_s = stall_s, max_gap_s
        self._since: float | None = None  # since when the engine has had work and no progress
        self._progress: float | None = None
        self._last: float | None = None

    def reset(self) -> None:
        """A scrape failed: what comes next starts a new period."""
        self._since = self._progress = self._last = None

    def observe(self, values: dict[str, float], now: float) -> bool:
        """True when the engine is hung (``values``: the scraped samples, summed per name)."""
        if self._last is not None and now - self._last > self.max_gap_s:
            self.reset()
        self._last = now
        load = sum(values.get(k, 0.0) for k in LOAD_GAUGES)
        progress = sum(values.get(k, 0.0) for k in PROGRESS_COUNTERS)
        if load <= 0 or self._since is None or progress != self._progress:
            self._since = now if load > 0 else None
            self._progress = progress
            return False
        return now - self._since >= self.stall_s

    def stalled_s(self, now: float) -> float:
        return 0.0 if self._since is None else now - self._since
