"""Is the engine making progress? vLLM's ``/health`` only says whether the engine has errored: it
passes while the EngineCore process is stopped or stuck, and requests then wait for the upstream
timeout. The replica therefore watches the engine's own counters (from ``/metrics``): an engine
that holds requests (running or waiting) while neither its generated nor its prompt-token count
moves for ``stall_s`` is hung. Prompt tokens count as progress so that a long prefill on a slow
CPU is not mistaken for a hang.

Those gauges come from the EngineCore itself, so an engine that stops between two reports keeps
showing its last figures; if it stopped while idle, they say "no work" forever. So an engine whose
counters have not moved for half of ``stall_s`` while it looks idle is asked for one token
(:meth:`StallWatch.should_probe`); a probe that gets no answer within ``stall_s`` from a server
that still answers ``/health`` means the engine is hung.

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
        self._moved: float | None = None  # when the counters last moved (or good scrapes began)
        self._idle = False

    def reset(self) -> None:
        """A scrape failed: what comes next starts a new period."""
        self._since = self._progress = self._last = self._moved = None

    def observe(self, values: dict[str, float], now: float) -> bool:
        """True when the engine is hung (``values``: the scraped samples, summed per name)."""
        if self._last is not None and now - self._last > self.max_gap_s:
            self.reset()
        self._last = now
        load = sum(values.get(k, 0.0) for k in LOAD_GAUGES)
        progress = sum(values.get(k, 0.0) for k in PROGRESS_COUNTERS)
        self._idle = load <= 0
        if self._moved is None or progress != self._progress:
            self._moved = now
        if load <= 0 or self._since is None or progress != self._progress:
            self._since = now if load > 0 else None
            self._progress = progress
            return False
        return now - self._since >= self.stall_s

    def should_probe(self, now: float) -> bool:
        """The engine looks idle and its counters have not moved for ``stall_s / 2``: ask it for a
        token (its gauges may be frozen)."""
        return self._idle and self._moved is not None and now - self._moved >= self.stall_s / 2

    def stalled_s(self, now: float) -> float:
        return 0.0 if self._since is None else now - self._since
