"""Tenant rate limits (requests and tokens per window), shared by every gateway replica.

Shared state lives in one small named Ray actor (``raystack-quota``, detached, zero CPU): it needs
no extra service, every gateway replica on any node reaches it, and an admission check is one
async actor call (about a millisecond). Counting is by fixed windows aligned to the clock, so
``x-ratelimit-reset-*`` is simply the time left in the window.

Tokens: admission reserves what a request may use at most (``n`` x ``max_tokens``) and admits it
only while the window's used plus reserved tokens are below the tenant's TPM, so concurrent
requests overshoot the limit by at most one reservation; when the request ends the reservation is
settled: the prompt plus completion tokens actually used are counted and the rest is given back.
A reservation that is never settled (its gateway died) lapses after ``hold_s``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from serving.errors import RateLimited

__all__ = ["Admission", "QuotaActor", "QuotaClient", "WindowCounter", "rate_limit_headers"]


@dataclass(frozen=True)
class Admission:
    allowed: bool
    reason: str  # "" | "requests" | "tokens"
    limit_requests: int | None
    remaining_requests: int | None
    limit_tokens: int | None
    remaining_tokens: int | None
    reset_s: float
    ticket: int = 0  # the token reservation to settle when the request ends (0: none)


class WindowCounter:
    """Per-tenant request and token counts in the current fixed window, and the token
    reservations of requests in progress. Pure, clock injected."""

    def __init__(self, hold_s: float = 3600.0) -> None:
        self.hold_s = hold_s
        self._windows: dict[str, tuple[int, int, int]] = {}  # tenant -> (window id, requests, tokens)
        self._tickets: dict[int, tuple[str, int, float]] = {}  # ticket -> (tenant, tokens, lapses at)
        self._next = 1

    def _current(self, tenant: str, window_s: float, now: float) -> tuple[int, int, int]:
        wid = int(now // window_s)
        w = self._windows.get(tenant)
        if w is None or w[0] != wid:
            w = (wid, 0, 0)
            self._windows[tenant] = w
        return w

    def reserved(self, tenant: str, now: float) -> int:
        for t in [t for t, (_, _, until) in self._tickets.items() if until <= now]:
            del self._tickets[t]
        return sum(tokens for name, tokens, _ in self._tickets.values() if name == tenant)

    def admit(
        self, tenant: str, rpm: int | None, tpm: int | None, window_s: float, now: float, reserve: int = 0
    ) -> Admission:
        wid, reqs, toks = self._current(tenant, window_s, now)
        held = self.reserved(tenant, now) if tpm is not None else 0
        reset = (wid + 1) * window_s - now
        reason = ""
        if rpm is not None and reqs >= rpm:
            reason = "requests"
        elif tpm is not None and toks + held >= tpm:
            reason = "tokens"
        ticket = 0
        if not reason:
            reqs += 1
            self._windows[tenant] = (wid, reqs, toks)
            if tpm is not None and reserve > 0:
                ticket, self._next = self._next, self._next + 1
                self._tickets[ticket] = (tenant, reserve, now + self.hold_s)
                held += reserve
        return Admission(
            allowed=not reason,
            reason=reason,
            limit_requests=rpm,
            remaining_requests=None if rpm is None else max(0, rpm - reqs),
            limit_tokens=tpm,
            remaining_tokens=None if tpm is None else max(0, tpm - toks - held),
            reset_s=reset,
            ticket=ticket,
        )

    def record(self, tenant: str, tokens: int, window_s: float, now: float, ticket: int = 0) -> None:
        """Count ``tokens`` used in the current window and give ``ticket``'s reservation back."""
        self._tickets.pop(ticket, None)
        wid, reqs, toks = self._current(tenant, window_s, now)
        self._windows[tenant] = (wid, reqs, toks + max(0, tokens))


def rate_limit_headers(a: Admission) -> dict[str, str]:
    reset = f"{max(1, math.ceil(a.reset_s))}s"
    h: dict[str, str] = {}
    if a.limit_requests is not None:
        h |= {
            "x-ratelimit-limit-requests": str(a.limit_requests),
            "x-ratelimit-remaining-requests": str(a.remaining_requests),
            "x-ratelimit-reset-requests": reset,
        }
    if a.limit_tokens is not None:
        h |= {
            "x-ratelimit-limit-tokens": str(a.limit_tokens),
            "x-ratelimit-remaining-tokens": str(a.remaining_tokens),
            "x-ratelimit-reset-tokens": reset,
        }
    return h


class QuotaActor:
    """The shared counter as a Ray actor (see module docstring)."""

    def __init__(self) -> None:
        self.counter = WindowCounter()

    def admit(self, tenant: str, rpm: int | None, tpm: int | None, window_s: float, reserve: int = 0) -> Admission:
        return self.counter.admit(tenant, rpm, tpm, window_s, time.time(), reserve)

    def record(self, tenant: str, tokens: int, window_s: float, ticket: int = 0) -> None:
        self.counter.record(tenant, tokens, window_s, time.time(), ticket)


class QuotaClient:
    """Gateway side: admission (raises :class:`RateLimited` with headers) and usage recording."""

    ACTOR_NAME, NAMESPACE = "raystack-quota", "raystack"

    def __init__(self, window_s: float, actor: Any = None) -> None:
        self.window_s = window_s
        self._actor = actor

    def _handle(self) -> Any:
        if self._actor is None:
            import ray

            self._actor = (
                ray.remote(QuotaActor)
                .options(
                    name=self.ACTOR_NAME,
                    namespace=self.NAMESPACE,
                    lifetime="detached",
                    get_if_exists=True,
                    num_cpus=0,
                    max_restarts=-1,
                )
                .remote()
            )
        return self._actor

    async def admit(
        self, tenant: str, rpm: int | None, tpm: int | None, reserve: int = 0
    ) -> tuple[dict[str, str], int]:
        """Admit one request reserving ``reserve`` tokens; returns the rate-limit headers and the
        reservation's ticket (for :meth:`record`)."""
        if rpm is None and tpm is None:
            return {}, 0
        a: Admission = await self._handle().admit.remote(tenant, rpm, tpm, self.window_s, reserve)
        headers = rate_limit_headers(a)
        if not a.allowed:
            retry = str(max(1, math.ceil(a.reset_s)))
            raise RateLimited(
                f"Rate limit reached for {a.reason} per {self.window_s:g}s window of tenant "
                f"'{tenant}'. Retry after {retry}s.",
                code=f"rate_limit_{a.reason}",
                headers={**headers, "retry-after": retry},
            )
        return headers, a.ticket

    def record(self, tenant: str, tokens: int, ticket: int = 0) -> None:
        """Settle a request: count the tokens it used, give the rest of its reservation back."""
        if tokens > 0 or ticket:
            self._handle().record.remote(tenant, tokens, self.window_s, ticket)
