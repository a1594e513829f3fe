"""Closed-loop streaming load for benchmarks: C workers, each sending its next request as soon as
the previous one finished, until N requests are done (asyncio + one pooled httpx client per
server; :func:`run_targets` spreads one loop over several servers or models).

Timings follow :mod:`loadtests.workload` (TTFT to the first token event; ITL per request).
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from loadtests.workload import Outcome, StreamMeter, outcome_of_body

__all__ = ["LevelResult", "Target", "ms", "percentile", "run_level", "run_targets", "send"]


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


def ms(seconds: float | None) -> float | None:
    """Seconds as milliseconds (None stays None)."""
    return None if seconds is None else seconds * 1000


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    failures: int
    wall_s: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    latency_p50_ms: float | None
    mean_prompt_tokens: float
    mean_output_tokens: float
    errors: list[str]
    client_cpu_s: float = 0.0  # CPU the client itself used: on a small machine it competes with the server

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def of(cls, concurrency: int, outs: list[Outcome], wall_s: float, client_cpu_s: float = 0.0) -> LevelResult:
        ok = [o for o in outs if o.ok]
        ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
        itl = [o.itl_s for o in ok if o.itl_s is not None]
        tokens = sum(o.tokens for o in ok)
        return cls(
            concurrency=concurrency,
            requests=len(outs),
            failures=len(outs) - len(ok),
            wall_s=wall_s,
            requests_per_s=len(ok) / wall_s,
            output_tokens_per_s=tokens / wall_s,
            ttft_p50_ms=ms(percentile(ttft, 50)),
            ttft_p99_ms=ms(percentile(ttft, 99)),
            itl_p50_ms=ms(percentile(itl, 50)),
            itl_p99_ms=ms(percentile(itl, 99)),
            latency_p50_ms=ms(percentile([o.latency_s for o in ok], 50)),
            mean_prompt_tokens=statistics.fmean([o.prompt_tokens for o in ok]) if ok else 0.0,
            mean_output_tokens=tokens / len(ok) if ok else 0.0,
            errors=sorted({o.error for o in outs if not o.ok})[:5],
            client_cpu_s=client_cpu_s,
        )


async def send(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> Outcome:
    start = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200 or not body.get("stream"):
                return outcome_of_body(resp.status_code, await resp.aread(), start, time.perf_counter())
            meter = StreamMeter(start)
            async for line in resp.aiter_lines():
                meter.line(line, time.perf_counter())
            return meter.outcome(time.perf_counter())
    except httpx.HTTPError as exc:
        return Outcome(False, time.perf_counter() - start, error=f"{type(exc).__name__}: {exc}"[:200])


@dataclass(frozen=True)
class Target:
    """Where one share of a level's requests goes: a server, its token, a route and a body factory."""

    base_url: str
    api_key: str | None
    path: str
    make_body: Callable[[], dict[str, Any]]


async def run_level(
    base_url: str,
    api_key: str | None,
    path: str,
    make_body: Callable[[], dict[str, Any]],
    concurrency: int,
    requests: int,
    warmup: int = 0,
    timeout_s: float = 120,
) -> LevelResult:
    """``warmup`` unrecorded requests (at the same concurrency), then ``requests`` recorded ones."""
    target = Target(base_url, api_key, path, make_body)
    return await run_targets([target], concurrency, requests, warmup, timeout_s)


async def run_targets(
    targets: Sequence[Target], concurrency: int, requests: int, warmup: int = 0, timeout_s: float = 120
) -> LevelResult:
    """One closed loop of ``concurrency`` workers over several targets: the k-th request sent goes
    to ``targets[k % len(targets)]`` (an even mix whatever each target's speed), one pooled
    client per target; ``warmup`` unrecorded requests first, as :func:`run_level`."""
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(
                httpx.AsyncClient(
                    base_url=t.base_url,
                    headers={"authorization": f"Bearer {t.api_key}"} if t.api_key else {},
                    limits=limits,
                    timeout=httpx.Timeout(timeout_s, connect=10),
                )
            )
            for t in targets
        ]
        sent = 0

        async def batch(n: int) -> list[Outcome]:
            left = n
            outs: list[Outcome] = []

            async def worker() -> None:
                nonlocal left, sent
                while left > 0:
                    left -= 1
                    k, sent = sent % len(targets), sent + 1
                    t = targets[k]
                    outs.append(await send(clients[k], t.path, t.make_body()))

            await asyncio.gather(*(worker() for _ in range(min(concurrency, n))))
            return outs

        if warmup:
            await batch(warmup)
        t0, cpu0 = time.perf_counter(), time.process_time()
        outs = await batch(requests)
        return LevelResult.of(concurrency, outs, time.perf_counter() - t0, time.process_time() - cpu0)
