"""Where model replicas can be reached, so gateways route to them without a Ray call per request.

Each model replica publishes its vLLM endpoint (URL, per-replica token) in Ray's GCS key-value
store under ``ep/<app>/<replica>`` and refreshes the record every ``HEARTBEAT_S`` while its engine
runs; it withdraws the record when Serve stops it (scale-down, promotion, shutdown) and then
drains. Each gateway replica reads all records every ``REFRESH_S`` and picks a replica per request
itself: power of two choices on its own in-flight counts (what Serve's default router does, minus
the Ray call). Why: on 2 cores, at 8 clients, the per-request lease through Serve's router kept
the model replica actor at ~0.15 cores and the gateway at 0.38 (0.01 and 0.28-0.30 without it),
and the stack served 10-30% more requests/s without it (docs/performance.md).

Each heartbeat bumps the record's sequence number. A gateway judges a record by when it last
saw it change, on its own monotonic clock (no wall clocks compared across nodes), and only counts
time during which it could read the store: a paused or slow GCS stalls both the heartbeats and
the reads, and is no sign that a replica died. A record unchanged for ``STALE_S`` of readable time
belongs to a replica that died without withdrawing (its node or process is gone); a record marked
``hung`` belongs to a replica whose engine stopped making progress (:mod:`serving.models.server`).
Either is dropped, and the requests still on it are told (``died``), as Ray tells a lease call
whose actor died: those without a first byte are retried elsewhere. After ``PURGE_S`` unchanged a
gateway deletes the record. A replica that fails a request is skipped for ``FAILED_S``. Pure logic
plus a thin wrapper over ``ray.experimental.internal_kv``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass
from typing import Protocol

logger = logging.getLogger("serving.endpoints")

__all__ = [
    "HEARTBEAT_S",
    "HUNG",
    "REFRESH_S",
    "STALE_S",
    "UP",
    "DirectLease",
    "EndpointTable",
    "KV",
    "RayKV",
    "Record",
    "publish",
    "read_records",
    "withdraw",
]

NAMESPACE = "raystack"
PREFIX = "ep/"
HEARTBEAT_S = 2.0
REFRESH_S = 1.0
STALE_S = 10.0
MAX_GAP_S = 3.0  # reads further apart than this: the store was unreadable meanwhile
PURGE_S = 60.0  # records unchanged this long are deleted by any gateway (their replica was killed)
FAILED_S = 5.0
UP, HUNG = "up", "hung"


class KV(Protocol):
    def put(self, key: str, value: bytes) -> None: ...

    def delete(self, key: str) -> None: ...

    def scan(self, prefix: str) -> dict[str, bytes]: ...


class RayKV:
    """Ray's GCS key-value store (the process must be connected to Ray, as Serve replicas are)."""

    def put(self, key: str, value: bytes) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(key, value, overwrite=True, namespace=NAMESPACE)

    def delete(self, key: str) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(key, namespace=NAMESPACE)

    def scan(self, prefix: str) -> dict[str, bytes]:
        from ray.experimental import internal_kv

        out: dict[str, bytes] = {}
        for key in internal_kv._internal_kv_list(prefix, namespace=NAMESPACE):
            name = key.decode() if isinstance(key, bytes) else key
            value = internal_kv._internal_kv_get(name, namespace=NAMESPACE)
            if value is not None:
                out[name] = value
        return out


@dataclass(frozen=True)
class Record:
    """One replica's endpoint. ``seq`` counts its heartbeats (only a change matters to readers);
    ``state`` is ``up``, or ``hung`` when the replica found its engine making no progress."""

    app: str
    replica: str
    url: str
    token: str
    seq: int
    state: str = UP


def _key(app: str, replica: str) -> str:
    return f"{PREFIX}{app}/{replica}"


def publish(kv: KV, app: str, replica: str, url: str, token: str, seq: int, state: str = UP) -> None:
    kv.put(_key(app, replica), json.dumps({"url": url, "token": token, "seq": seq, "state": state}).encode())


def withdraw(kv: KV, app: str, replica: str) -> None:
    kv.delete(_key(app, replica))


def read_records(kv: KV) -> list[Record]:
    out = []
    for key, raw in kv.scan(PREFIX).items():
        app, _, replica = key.removeprefix(PREFIX).partition("/")
        try:
            v = json.loads(raw)
            out.append(Record(app, replica, str(v["url"]), str(v["token"]), int(v["seq"]), str(v.get("state", UP))))
        except (ValueError, KeyError, TypeError):
            logger.warning("ignoring an unreadable endpoint record %s", key)
    return out


class DirectLease:
    """A replica picked by the gateway itself; ``release`` gives its slot back."""

    __slots__ = ("_done", "_table", "died", "replica", "token", "url")
    route = "direct"

    def __init__(self, table: EndpointTable, record: Record) -> None:
        self._table, self._done = table, False
        self.url, self.token, self.replica = record.url, record.token, record.replica
        self.died = asyncio.Event()

    def release(self, failed: bool = False) -> None:
        if not self._done:
            self._done = True
            self._table._release(self, failed)


class EndpointTable:
    """One gateway replica's view of the live model replicas, and its requests on each.

    Staleness is judged on this gateway's own monotonic clock: a record is stale when this
    gateway has not seen it change for ``stale_s`` while it could read the store. After a failed
    read, or reads further apart than ``max_gap_s`` (the store was paused or slow), the quiet time
    of every record starts again at the next good read, so nothing is declared stale until the
    store has been readable for a full ``stale_s``."""

    def __init__(
        self,
        stale_s: float = STALE_S,
        failed_s: float = FAILED_S,
        rng: random.Random | None = None,
        max_gap_s: float = MAX_GAP_S,
    ) -> None:
        self.stale_s, self.failed_s, self.max_gap_s = stale_s, failed_s, max_gap_s
        self._rng = rng or random.Random()
        self._by_app: dict[str, dict[str, Record]] = {}
        self._leases: dict[str, set[DirectLease]] = {}  # open leases per replica: its in-flight count
        self._failed_until: dict[str, float] = {}
        self._stale: set[str] = set()
        self._changed: dict[tuple[str, str], tuple[int, float]] = {}  # (app, replica) -> (seq, seen at)
        self._readable_since: float | None = None  # good reads without a gap since then
        self._last_read: float | None = None
        self.loaded = False  # records were read at least once

    def read_failed(self) -> None:
        """Reading the store failed: until it has been read again for ``stale_s``, nothing is stale."""
        self._readable_since = None

    def quiet_s(self, app: str, replica: str, now: float) -> float:
        """How long this gateway has seen the record unchanged while the store was readable."""
        seen = self._changed.get((app, replica))
        if seen is None or self._readable_since is None:
            return 0.0
        return now - max(seen[1], self._readable_since)

    def update(self, records: list[Record], now: float | None = None) -> list[str]:
        """Replace the view with a fresh read; returns the replicas newly found dead: stale (no
        heartbeat seen) or marked ``hung``. Their in-flight requests are told ``died``. A
        withdrawn record (a draining replica) only stops new picks."""
        now = time.monotonic() if now is None else now
        gap = self._last_read is not None and now - self._last_read > self.max_gap_s
        if self._readable_since is None or gap:
            self._readable_since = now
        self._last_read = now
        changed: dict[tuple[str, str], tuple[int, float]] = {}
        for r in records:
            prev = self._changed.get((r.app, r.replica))
            changed[(r.app, r.replica)] = (r.seq, prev[1] if prev is not None and prev[0] == r.seq else now)
        self._changed = changed
        fresh: dict[str, dict[str, Record]] = {}
        dead = []
        for r in records:
            if r.state != UP or self.quiet_s(r.app, r.replica, now) > self.stale_s:
                dead.append(r.replica)
            else:
                fresh.setdefault(r.app, {})[r.replica] = r
        for replica in dead:
            for lease in self._leases.get(replica, ()):
                lease.died.set()
        newly = [r for r in dead if r not in self._stale]
        self._by_app, self._stale, self.loaded = fresh, set(dead), True
        return newly

    def expired(self, now: float | None = None) -> list[tuple[str, str]]:
        """(app, replica) of records unchanged for ``PURGE_S`` of readable time: their replica was
        killed without withdrawing, and any gateway deletes them."""
        now = time.monotonic() if now is None else now
        return [key for key in self._changed if self.quiet_s(*key, now) > PURGE_S]

    def apps(self) -> dict[str, list[str]]:
        return {app: sorted(reps) for app, reps in self._by_app.items()}

    def pick(self, app: str, limit: int = 0, now: float | None = None) -> DirectLease | None:
        """Power of two choices over ``app``'s live replicas by this gateway's in-flight counts;
        None when it has none (cold, not yet seen) or both choices are at ``limit`` (then
        Serve's router queues the request)."""
        now = time.monotonic() if now is None else now
        reps = [r for r in self._by_app.get(app, {}).values() if self._failed_until.get(r.replica, 0) <= now]
        if not reps:
            return None
        pair = self._rng.sample(reps, 2) if len(reps) > 1 else reps
        best = min(pair, key=lambda r: self.in_flight(r.replica))
        if limit and self.in_flight(best.replica) >= limit:
            return None
        lease = DirectLease(self, best)
        self._leases.setdefault(best.replica, set()).add(lease)
        return lease

    def in_flight(self, replica: str) -> int:
        return len(self._leases.get(replica, ()))

    def _release(self, lease: DirectLease, failed: bool) -> None:
        leases = self._leases.get(lease.replica)
        if leases is not None:
            leases.discard(lease)
            if not leases:
                del self._leases[lease.replica]
        if failed:
            self._failed_until[lease.replica] = time.monotonic() + self.failed_s

    async def refresh_forever(self, kv: KV, period_s: float = REFRESH_S) -> None:
        """Gateway background task: re-read the records every ``period_s``; delete the expired."""
        while True:
            try:
                records = await asyncio.to_thread(read_records, kv)
                dead = self.update(records)
                if dead:
                    logger.warning("model replicas without heartbeat or hung (dropped): %s", dead)
                for app, replica in self.expired():
                    await asyncio.to_thread(withdraw, kv, app, replica)
            except Exception as exc:  # noqa: BLE001 - keep the last view; Serve's leases still work
                self.read_failed()
                logger.warning("reading model endpoints failed: %s", exc)
            await asyncio.sleep(period_s)
