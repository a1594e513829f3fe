"""Finding a model replica for each request: the gateway's replica table and Serve leases.

Every way of getting a replica ends in a :class:`Lease` (URL, token, a ``died`` event, ``release``):

- :class:`DirectLease` from the :class:`EndpointTable`: each gateway replica reads the endpoint
  records that model replicas publish (:mod:`serving.contract`) every ``REFRESH_S`` and picks per
  request itself, power of two choices on its own in-flight counts (what Serve's default router
  does, minus the Ray call per request).
- :class:`ServeLease` (:mod:`serving.gateway.leases`) from a Serve deployment handle: one
  streaming call to the replica's ``lease`` method that yields its endpoint and stays open until
  the request ends, so Serve's router, queue and backpressure see the request. Used by requests
  that need a routing hint (prefix or session affinity), for an app with no known endpoint (cold,
  scaled to zero), when the picked replicas are at their limit, and for every request under
  ``replica_routing: serve``.

:class:`ReplicaFinder` chooses between the two. Each heartbeat bumps a record's sequence number.
A gateway judges a record by when it last saw it change, on its own monotonic clock (no wall
clocks compared across nodes), and only counts time during which it could read the store: a
paused or slow GCS stalls both the heartbeats and the reads, and is no sign that a replica died.
A record unchanged for ``STALE_S`` of readable time belongs to a replica that died without
withdrawing (its node or process is gone); a record marked ``hung`` belongs to a replica whose
engine stopped making progress (:mod:`serving.replica.server`). Either is dropped, and the
requests still on it are told (``died``), as Ray tells a lease call whose actor died: those
without a first byte are retried elsewhere. After ``PURGE_S`` unchanged a gateway deletes the
record. A replica that fails a request is skipped for ``FAILED_S``. One whose engine answers that
it does not hold an adapter its record lists (unregistered while this gateway could not read the
store) gets no request for that adapter until its record changes (:meth:`EndpointTable.not_holding`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Sequence
from functools import partial
from typing import Any, Protocol, cast

from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from serving.contract import (
    KV,
    REFRESH_S,
    UP,
    AdapterRefused,
    BlockKey,
    Endpoint,
    LeaseHint,
    RayKV,
    Record,
    read_records,
    withdraw,
)
from serving.errors import InternalError, unavailable
from serving.gateway.kv_index import LOAD_BLOCKS, KVFeeds, KVIndex
from serving.gateway.leases import ServeLease, cancel_call

logger = logging.getLogger("serving.gateway")

__all__ = [
    "FAILED_S",
    "MAX_GAP_S",
    "PURGE_S",
    "STALE_S",
    "DirectLease",
    "EndpointTable",
    "Lease",
    "LeaseProvider",
    "ReplicaFinder",
    "ReplicaGone",
    "ServeLease",
]

STALE_S = 10.0
MAX_GAP_S = 3.0  # reads further apart than this: the store was unreadable meanwhile
PURGE_S = 60.0  # records unchanged this long are deleted by any gateway (their replica was killed)
FAILED_S = 5.0


class Lease(Protocol):
    """A replica chosen for one request, held until the request ends. A lease for a LoRA adapter
    also has ``adapter`` (its name) and ``adapter_missing()``: the replica's engine answered that
    it does not hold the adapter (:mod:`serving.gateway.relay` then retries elsewhere)."""

    url: str
    token: str
    replica: str
    died: asyncio.Event  # set when the replica is known dead (Ray or the heartbeat says so)
    route: str  # "direct" (picked by the gateway) or "serve" (leased through Serve's router)

    def release(self, failed: bool = False) -> None: ...


class LeaseProvider(Protocol):
    async def lease(
        self, app: str, hint: LeaseHint, timeout_s: float, limit: int = 0, loaded_first: bool = True
    ) -> Lease: ...

    async def ready(self, app: str, timeout_s: float) -> bool: ...


class ReplicaGone(Exception):
    """The replica to lease died before answering; the request is retried on another."""


class DirectLease:
    """A replica picked by the gateway itself; ``release`` gives its slot back."""

    __slots__ = ("_done", "_table", "adapter", "app", "died", "replica", "token", "url")
    route = "direct"

    def __init__(self, table: EndpointTable, record: Record, adapter: str | None = None) -> None:
        self._table, self._done = table, False
        self.url, self.token, self.replica = record.url, record.token, record.replica
        self.app, self.adapter = record.app, adapter
        self.died = asyncio.Event()

    def release(self, failed: bool = False) -> None:
        if not self._done:
            self._done = True
            self._table._release(self, failed)

    def adapter_missing(self) -> None:
        if self.adapter is not None:
            self._table.not_holding(self.app, self.replica, self.adapter)


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
        # (app, replica) -> adapters its engine said it does not hold, with the record's seq then
        self._lacks: dict[tuple[str, str], dict[str, int]] = {}
        self.kv_index: KVIndex | None = None  # router kv_aware: the engines' cached blocks

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
        self._lacks = {  # until the replica publishes again: then its record says what it holds
            key: kept
            for key, lacks in self._lacks.items()
            if (kept := {a: seq for a, seq in lacks.items() if changed.get(key, (None,))[0] == seq})
        }
        return newly

    def not_holding(self, app: str, replica: str, adapter: str) -> None:
        """The replica's engine does not hold ``adapter``, whatever the record this gateway last
        read says (it was unregistered while the store could not be read): no adapter request is
        picked for it there until its record changes."""
        record = self._by_app.get(app, {}).get(replica)
        if record is not None and adapter in record.adapters:
            self._lacks.setdefault((app, replica), {})[adapter] = record.seq
            logger.warning("replica %s no longer holds adapter %s; its record is out of date", replica, adapter)

    def _holds(self, record: Record, adapter: str) -> bool:
        lacks = self._lacks.get((record.app, record.replica))
        return adapter in record.adapters and (lacks is None or lacks.get(adapter) != record.seq)

    def expired(self, now: float | None = None) -> list[tuple[str, str]]:
        """(app, replica) of records unchanged for ``PURGE_S`` of readable time: their replica was
        killed without withdrawing, and any gateway deletes them."""
        now = time.monotonic() if now is None else now
        return [key for key in self._changed if self.quiet_s(*key, now) > PURGE_S]

    def pick(
        self,
        app: str,
        limit: int = 0,
        now: float | None = None,
        adapter: str | None = None,
        blocks: Sequence[BlockKey] | None = None,
    ) -> DirectLease | None:
        """Power of two choices over ``app``'s live replicas by this gateway's in-flight counts;
        None when it has none (cold, not yet seen) or both choices are at ``limit`` (then
        Serve's router queues the request). With ``adapter``, only the replicas whose record
        lists it (registered with their engine): None when none does. With ``blocks`` (the
        request's block keys, ``router: kv_aware``), the replica with the best
        ``matched blocks - LOAD_BLOCKS x in-flight``; on a tie the one with fewer in flight, then
        the one holding fewer blocks (a new prefix goes where the cache has most room)."""
        now = time.monotonic() if now is None else now
        reps = [r for r in self._by_app.get(app, {}).values() if self._failed_until.get(r.replica, 0) <= now]
        if adapter is not None:
            reps = [r for r in reps if self._holds(r, adapter)]
        if not reps:
            return None
        if blocks and self.kv_index is not None:
            best = self._by_cache(app, reps, blocks, now)
        else:
            pair = self._rng.sample(reps, 2) if len(reps) > 1 else reps
            best = min(pair, key=lambda r: self.in_flight(r.replica))
        if limit and self.in_flight(best.replica) >= limit:
            return None
        if blocks and self.kv_index is not None:
            self.kv_index.routed(app, best.replica, blocks, now)
        lease = DirectLease(self, best, adapter)
        self._leases.setdefault(best.replica, set()).add(lease)
        return lease

    def _by_cache(self, app: str, reps: list[Record], blocks: Sequence[BlockKey], now: float) -> Record:
        index = self.kv_index
        assert index is not None
        self._rng.shuffle(reps)  # ties beyond load go anywhere

        def score(r: Record) -> tuple[float, int, int]:
            load = self.in_flight(r.replica)
            matched = index.matched(app, r.replica, blocks, now)
            return matched - LOAD_BLOCKS * load, -load, -index.blocks_held(app, r.replica)

        return max(reps, key=score)

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

    def live(self) -> list[Record]:
        return [r for reps in self._by_app.values() for r in reps.values()]

    async def refresh_forever(self, kv: KV, period_s: float = REFRESH_S, feeds: KVFeeds | None = None) -> None:
        """Gateway background task: re-read the records every ``period_s``; delete the expired;
        follow the KV-block streams of the live records (``feeds``)."""
        while True:
            try:
                records = await asyncio.to_thread(read_records, kv)
                dead = self.update(records)
                if feeds is not None:
                    feeds.sync(self.live())
                if dead:
                    logger.warning("model replicas without heartbeat or hung (dropped): %s", dead)
                for app, replica in self.expired():
                    await asyncio.to_thread(withdraw, kv, app, replica)
            except Exception as exc:  # noqa: BLE001 - keep the last view; Serve's leases still work
                self.read_failed()
                logger.warning("reading model endpoints failed: %s", exc)
            await asyncio.sleep(period_s)


class ReplicaFinder:
    """Finds a model replica for each request. With ``direct``, requests that need no routing
    hint (power of two choices) go to a replica this gateway picks from the published endpoints,
    with no Ray call; the others, and any request for an app with no known endpoint (cold, scaled
    to zero) or whose picked replicas are at ``limit``, lease through Serve's handle and router."""

    def __init__(self, direct: bool = False, kv: KV | None = None) -> None:
        self._handles: dict[str, DeploymentHandle[Any]] = {}
        self.table = EndpointTable() if direct else None
        # router kv_aware picks among the published endpoints: only with direct routing
        self.feeds = KVFeeds() if direct else None
        if self.table is not None and self.feeds is not None:
            self.table.kv_index = self.feeds.index
        self._kv = kv
        self._refresher: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start reading endpoints (in the replica's event loop; ``Gateway.reconfigure`` calls it
        before the first request, as Serve applies the user_config before serving)."""
        if self.table is not None and self._refresher is None:
            self._refresher = asyncio.ensure_future(self.table.refresh_forever(self._kv or RayKV(), feeds=self.feeds))

    def stop(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        if self.feeds is not None:
            self.feeds.stop()

    def _handle(self, app: str) -> DeploymentHandle[Any]:
        h = self._handles.get(app)
        if h is None:
            h = serve.get_deployment_handle(app, app_name=app).options(stream=True)
            self._handles[app] = h
        return h

    async def lease(
        self, app: str, hint: LeaseHint, timeout_s: float, limit: int = 0, loaded_first: bool = True
    ) -> Lease:
        """A replica of ``app`` for one request. For an adapter (``hint.adapter``) with
        ``loaded_first``: a replica that holds it, picked here; else Serve's router with the
        adapter as multiplexed model id (a holder, then the replica with the fewest adapters),
        whose ``lease`` registers it. Without ``loaded_first``, Serve's router picks any replica."""
        direct = hint.prompt is None and hint.session_id is None and (hint.adapter is None or loaded_first)
        if self.table is not None and direct:
            picked = self.table.pick(app, limit, adapter=hint.adapter, blocks=hint.blocks)
            if picked is not None:
                return picked
        handle = self._handle(app)
        if hint.adapter is not None and loaded_first:
            handle = handle.options(multiplexed_model_id=hint.adapter)
        # the handle streams (``options(stream=True)``): the call is a response generator
        gen = cast("DeploymentResponseGenerator[Endpoint]", handle.lease.remote(hint))
        try:
            endpoint = await asyncio.wait_for(gen.__anext__(), timeout_s)
        except BackPressureError:
            raise unavailable(f"Model '{app}' is at capacity; retry shortly.", 1) from None
        except TimeoutError:
            cancel_call(gen)  # still waiting for a replica: withdraw the request
            raise unavailable(f"No replica of '{app}' became available in {timeout_s:.0f}s.", 5) from None
        except asyncio.CancelledError:  # the client left: a lease granted now would be held forever
            cancel_call(gen)
            raise
        except (ActorDiedError, ActorUnavailableError, RayActorError, StopAsyncIteration) as exc:
            raise ReplicaGone(f"replica unavailable: {type(exc).__name__}") from None
        except DeploymentUnavailableError:
            raise unavailable(f"Model '{app}' is not deployed right now.", 5) from None
        except AdapterRefused as exc:  # every replica of the base would refuse it: no retry
            logger.warning("adapter %s refused by a replica of %s: %s", hint.adapter, app, exc)
            raise InternalError(
                f"The adapter '{hint.adapter}' cannot be served: its replica refused to load it "
                "(the gateway's log says why).",
                code="adapter_refused",
            ) from None
        except RuntimeError as exc:  # the replica refused (its engine process is down)
            raise ReplicaGone(f"replica refused lease: {exc}") from None
        adapter, table = hint.adapter, self.table
        missing = partial(table.not_holding, app, endpoint.replica, adapter) if table and adapter else None
        return ServeLease(gen, endpoint, adapter, missing)

    async def ready(self, app: str, timeout_s: float) -> bool:
        try:
            h = serve.get_deployment_handle(app, app_name=app)
            return bool(await asyncio.wait_for(h.ready.remote(), timeout_s))
        except Exception:
            return False
