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

A new engine is warmed up before its replica takes requests (:func:`warm_up`), so that vLLM's
first compile of a kernel is not taken for a hang.
"""

from __future__ import annotations

import logging
import time

import httpx

logger = logging.getLogger("ray.serve")

__all__ = ["ONE_TOKEN", "PROGRESS_COUNTERS", "StallWatch", "warm_up"]

# One token of token id 0: what the stall watch asks a generate engine for (``_probe_engine``).
ONE_TOKEN = {"prompt": [0], "max_tokens": 1}
# The same with logprobs: vLLM compiles its logprob-rank kernel (``batched_count_greater_than``,
# ``torch.compile``) on the first request that asks for logprobs; see :func:`warm_up`.
WARM_UP = {**ONE_TOKEN, "logprobs": 1}

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


def warm_up(url: str, token: str, model: str, timeout_s: float, client: httpx.Client | None = None) -> None:
    """Ask a new engine for one token with logprobs before its replica takes requests. vLLM
    compiles its logprob-rank kernel on the first request that wants logprobs; on CPU that is
    inductor building C++, seconds of a busy engine that generates nothing, during which a client's
    request waits and the stall watch (``stall_timeout_s``) may take the engine for hung. Paid
    here, the kernel is also in the node's compile cache for the engines that start after it. A
    failed warm-up is logged, not fatal: the engine answered ``/health``."""
    t0 = time.monotonic()
    c = client or httpx.Client(timeout=timeout_s)
    try:
        r = c.post(
            f"{url}/v1/completions", json={"model": model, **WARM_UP}, headers={"authorization": f"Bearer {token}"}
        )
    except httpx.HTTPError as exc:
        logger.warning("engine warm-up failed: %s", type(exc).__name__)
        return
    finally:
        if client is None:
            c.close()
    if r.status_code != 200:
        logger.warning("engine warm-up answered %d: %s", r.status_code, r.text[:200])
    else:
        logger.info("engine warmed up (logprobs kernel) in %.1fs", time.monotonic() - t0)
