"""Tenant rate limits (requests and tokens per window), shared by every gateway replica.

Shared state lives in one small named Ray actor (``raystack-quota``, detached, zero CPU): it needs
no extra service, every gateway replica on any node reaches it, and an admission check is one
async actor call (about a millisecond). Counting is by fixed windows aligned to the clock, so
``x-ratelimit-reset-*`` is simply the time left in the window.

Tokens: admission reserves what a request may be billed at most (its prompt and completions,
bounded by :mod:`.reserve`) and admits it only while the window's used plus reserved tokens are
below the tenant's TPM, so a window bills less than the TPM plus one reservation, as long as no
request uses more than it reserved; when the request ends the reservation is settled: the prompt
plus completion tokens actually used are counted and the rest is given back.
A reservation that is never settled (its gateway died) lapses after ``hold_s``.

Streams: a tenant's ``max_streams`` caps its streams in progress across every gateway replica;
each admitted stream holds a ticket until it ends (the same settle call; lapsing the same way).

Tickets: a ticket's id is a random 63-bit integer, so ids stay unique across the actor's restarts
(a counter restored from a checkpoint would hand out again the ids issued after it), and a settle
call frees a ticket only if it names the ticket's tenant.

Failure: admission waits at most ``timeout_s`` for the actor; if it does not answer (dead,
restarting, overloaded) the request is admitted unchecked (``failure_mode: open``) or refused with
503 and ``Retry-After`` (``closed``), never a 500; what the actor admits after that (its call was
queued) is given back when it lands. The actor is restarted by Ray
(``max_restarts=-1``) and checkpoints its windows and reservations to Ray's key-value store
every ``CHECKPOINT_S``, reloading them when it starts, so a restart loses at most that much.
A restored ticket may belong to a request still in progress (it is settled as usual) or to one
whose settle call came after the checkpoint and was lost: a restored ticket is therefore held
for at most ``RESTORED_HOLD_S`` more (five minutes, the default ``first_byte_timeout_s``: the
longest a try may wait for its first byte or its whole non-streamed answer), not ``hold_s``.
A request still running after that keeps running and its settle call still counts its tokens;
only its reservation and stream slot are no longer held.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

from serving.errors import RateLimited, Unavailable

logger = logging.getLogger("serving.gateway")

__all__ = ["ON_HEAD", "Admission", "QuotaActor", "QuotaClient", "WindowCounter", "rate_limit_headers"]

CHECKPOINT_KEY = "quota/state"
# Where the gateway's shared actors (quota, stored responses) run: on the Ray head, through its
# head-node resource, as Ray Train places its state actor. Zero-CPU actors could otherwise land on
# any node, the promotion controller's pod among them (its Kubernetes API token, its write access
# to the store).
ON_HEAD = {"node:__internal_head__": 0.001}
CHECKPOINT_S = 0.5
RESTORED_HOLD_S = 300.0  # how long a ticket restored from a checkpoint is held at most (docstring)


@dataclass(frozen=True)
class Admission:
    allowed: bool
    reason: str  # "" | "requests" | "tokens"
    limit_requests: int | None
    remaining_requests: int | None
    limit_tokens: int | None
    remaining_tokens: int | None
    reset_s: float
    ticket: int = 0  # the token reservation / stream slot to settle when the request ends (0: none)


class WindowCounter:
    """Per-tenant request and token counts in the current fixed window, and the token
    reservations of requests in progress. Pure, clock injected."""

    def __init__(self, hold_s: float = 3600.0) -> None:
        self.hold_s = hold_s
        self._windows: dict[str, tuple[int, int, int]] = {}  # tenant -> (window id, requests, tokens)
        self._tickets: dict[int, tuple[str, int, float, bool]] = {}  # -> (tenant, tokens, lapses at, stream)

    def _current(self, tenant: str, window_s: float, now: float) -> tuple[int, int, int]:
        wid = int(now // window_s)
        w = self._windows.get(tenant)
        if w is None or w[0] != wid:
            w = (wid, 0, 0)
            self._windows[tenant] = w
        return w

    def reserved(self, tenant: str, now: float) -> int:
        for t in [t for t, v in self._tickets.items() if v[2] <= now]:
            del self._tickets[t]
        return sum(v[1] for v in self._tickets.values() if v[0] == tenant)

    def streams(self, tenant: str) -> int:
        return sum(1 for v in self._tickets.values() if v[0] == tenant and v[3])

    def admit(
        self,
        tenant: str,
        rpm: int | None,
        tpm: int | None,
        window_s: float,
        now: float,
        reserve: int = 0,
        stream: bool = False,
        max_streams: int | None = None,
    ) -> Admission:
        wid, reqs, toks = self._current(tenant, window_s, now)
        held = self.reserved(tenant, now)
        reserve = reserve if tpm is not None else 0
        slot = stream and max_streams is not None
        reset = (wid + 1) * window_s - now
        reason = ""
        if stream and max_streams is not None and self.streams(tenant) >= max_streams:
            reason = "streams"
        elif rpm is not None and reqs >= rpm:
            reason = "requests"
        elif tpm is not None and toks + held >= tpm:
            reason = "tokens"
        ticket = 0
        if not reason:
            reqs += 1
            self._windows[tenant] = (wid, reqs, toks)
            if reserve > 0 or slot:
                ticket = self._new_ticket()
                self._tickets[ticket] = (tenant, reserve, now + self.hold_s, slot)
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

    def _new_ticket(self) -> int:
        """A random id (module docstring: unique across restarts), never 0 (no ticket)."""
        ticket = 0
        while not ticket or ticket in self._tickets:
            ticket = secrets.randbits(63)
        return ticket

    def record(self, tenant: str, tokens: int, window_s: float, now: float, ticket: int = 0) -> None:
        """Count ``tokens`` used in the current window and give ``ticket``'s reservation back
        (only ``tenant``'s: another tenant's ticket is left alone)."""
        held = self._tickets.get(ticket)
        if held is not None and held[0] == tenant:
            del self._tickets[ticket]
        elif held is not None:
            logger.warning("quota ticket settled by tenant %s is not its own: kept", tenant)
        wid, reqs, toks = self._current(tenant, window_s, now)
        self._windows[tenant] = (wid, reqs, toks + max(0, tokens))

    def state(self) -> dict[str, Any]:
        """Everything counted, JSON-able (the actor's checkpoint)."""
        return {
            "windows": {t: list(w) for t, w in self._windows.items()},
            "tickets": {str(k): list(v) for k, v in self._tickets.items()},
        }

    @classmethod
    def from_state(
        cls, state: dict[str, Any], now: float, hold_s: float = 3600.0, restored_hold_s: float = RESTORED_HOLD_S
    ) -> WindowCounter:
        """The counts of :meth:`state`, restored at ``now``: each ticket held for at most
        ``restored_hold_s`` more (module docstring)."""
        c = cls(hold_s)
        c._windows = {t: (int(w[0]), int(w[1]), int(w[2])) for t, w in state.get("windows", {}).items()}
        c._tickets = {
            int(k): (str(v[0]), int(v[1]), min(float(v[2]), now + restored_hold_s), bool(v[3]) if len(v) > 3 else False)
            for k, v in state.get("tickets", {}).items()
        }
        return c


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
    """The shared counter as a Ray actor (see module docstring). ``kv`` (Ray's key-value store
    when None) holds its checkpoint; a thread writes it every ``checkpoint_s`` if anything changed,
    so no admission waits on that write."""

    def __init__(self, kv: Any = None, checkpoint_s: float = CHECKPOINT_S) -> None:
        if kv is None:
            from serving.contract import RayKV

            kv = RayKV()
        self._kv, self._lock, self._dirty = kv, threading.Lock(), False
        self.counter = WindowCounter()
        try:
            raw = kv.scan(CHECKPOINT_KEY).get(CHECKPOINT_KEY)
            if raw:
                self.counter = WindowCounter.from_state(json.loads(raw), time.time())
                logger.warning("quota counts restored from the checkpoint")
        except Exception as exc:  # noqa: BLE001 - an unreadable checkpoint: start counting afresh
            logger.warning("quota checkpoint not restored: %s", exc)
        if checkpoint_s > 0:
            threading.Thread(target=self._checkpoint_forever, args=(checkpoint_s,), daemon=True).start()

    def admit(
        self,
        tenant: str,
        rpm: int | None,
        tpm: int | None,
        window_s: float,
        reserve: int = 0,
        stream: bool = False,
        max_streams: int | None = None,
    ) -> Admission:
        with self._lock:
            self._dirty = True
            return self.counter.admit(tenant, rpm, tpm, window_s, time.time(), reserve, stream, max_streams)

    def record(self, tenant: str, tokens: int, window_s: float, ticket: int = 0) -> None:
        with self._lock:
            self._dirty = True
            self.counter.record(tenant, tokens, window_s, time.time(), ticket)

    def checkpoint(self) -> bool:
        """Write the counts if they changed since the last write; True if written."""
        with self._lock:
            if not self._dirty:
                return False
            state, self._dirty = json.dumps(self.counter.state()).encode(), False
        self._kv.put(CHECKPOINT_KEY, state)
        return True

    def _checkpoint_forever(self, period_s: float) -> None:
        while True:
            time.sleep(period_s)
            try:
                self.checkpoint()
            except Exception as exc:  # noqa: BLE001 - keep counting; the next write may succeed
                logger.warning("quota checkpoint failed: %s", exc)


class QuotaClient:
    """Gateway side: admission (raises :class:`RateLimited` with headers, or :class:`Unavailable`
    when the actor cannot answer and ``failure_mode`` is ``closed``) and usage recording.
    ``actor``: anything with the actor's ``admit``/``record`` remote methods."""

    ACTOR_NAME, NAMESPACE = "raystack-quota", "raystack"

    def __init__(self, window_s: float, actor: Any = None, timeout_s: float = 2.0, failure_mode: str = "open") -> None:
        self.window_s, self.timeout_s, self.failure_mode = window_s, timeout_s, failure_mode
        self._actor = actor
        self.failures = 0  # admissions decided without the actor (for logs and tests)

    @property
    def actor(self) -> Any:
        """The actor handle, if one was made (kept across reconfigurations)."""
        return self._actor

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
                    resources=ON_HEAD,
                    max_restarts=-1,
                )
                .remote()
            )
        return self._actor

    async def admit(
        self,
        tenant: str,
        rpm: int | None,
        tpm: int | None,
        reserve: int = 0,
        stream: bool = False,
        max_streams: int | None = None,
    ) -> tuple[dict[str, str], int]:
        """Admit one request reserving ``reserve`` tokens (and, for a stream under ``max_streams``,
        a stream slot); returns the rate-limit headers and the ticket to settle (:meth:`record`)."""
        if rpm is None and tpm is None and (max_streams is None or not stream):
            return {}, 0
        # The actor call goes on after the gateway stops waiting for it (a timeout, or the client
        # left): an admission that lands later is settled at once, not held for ``hold_s``.
        call = asyncio.ensure_future(self._admit(tenant, rpm, tpm, reserve, stream, max_streams))
        try:
            a: Admission = await asyncio.wait_for(asyncio.shield(call), self.timeout_s)
        except asyncio.CancelledError:
            call.add_done_callback(lambda done: self._settle_late(tenant, done))
            raise
        except Exception as exc:  # noqa: BLE001 - timeout, actor dead or restarting: the failure mode decides
            call.add_done_callback(lambda done: self._settle_late(tenant, done))
            return self._failed(tenant, exc)
        headers = rate_limit_headers(a)
        if a.reason == "streams":
            raise RateLimited(
                f"Too many concurrent streams for tenant '{tenant}' (limit {max_streams}). Retry shortly.",
                code="rate_limit_streams",
                headers={**headers, "retry-after": "1"},
            )
        if not a.allowed:
            retry = str(max(1, math.ceil(a.reset_s)))
            raise RateLimited(
                f"Rate limit reached for {a.reason} per {self.window_s:g}s window of tenant "
                f"'{tenant}'. Retry after {retry}s.",
                code=f"rate_limit_{a.reason}",
                headers={**headers, "retry-after": retry},
            )
        return headers, a.ticket

    async def _admit(
        self, tenant: str, rpm: int | None, tpm: int | None, reserve: int, stream: bool, max_streams: int | None
    ) -> Admission:
        handle = self._actor if self._actor is not None else await asyncio.to_thread(self._handle)
        a: Admission = await handle.admit.remote(tenant, rpm, tpm, self.window_s, reserve, stream, max_streams)
        return a

    def _settle_late(self, tenant: str, done: asyncio.Future[Admission]) -> None:
        """Give back what an admission the gateway no longer waited for reserved."""
        if done.cancelled() or done.exception() is not None:
            return
        ticket = done.result().ticket
        if ticket:
            self.record(tenant, 0, ticket)

    def _failed(self, tenant: str, exc: BaseException) -> tuple[dict[str, str], int]:
        self.failures += 1
        if type(exc).__name__ == "ActorDiedError":  # gone for good: look it up (or start it) again
            self._actor = None
        what = "timed out" if isinstance(exc, TimeoutError) else type(exc).__name__
        logger.warning("quota check for tenant %s failed (%s): failing %s", tenant, what, self.failure_mode)
        if self.failure_mode == "closed":
            raise Unavailable(
                "Rate limits cannot be checked right now; retry shortly.", headers={"retry-after": "1"}
            ) from None
        return {}, 0

    def record(self, tenant: str, tokens: int, ticket: int = 0) -> None:
        """Settle a request: count the tokens it used, give the rest of its reservation back."""
        if (tokens > 0 or ticket) and self._actor is not None:
            try:
                self._actor.record.remote(tenant, tokens, self.window_s, ticket)
            except Exception as exc:  # noqa: BLE001 - the count is lost, the request is not
                logger.warning("recording usage of tenant %s failed: %s", tenant, exc)
