"""The gateway's store of Responses API responses (``store: true``), shared by every gateway replica.

vLLM's own response store lives in per-process dictionaries that are never cleared, are not
scoped to a tenant and vanish with the replica, so it stays off; the gateway keeps conversation
state itself. A stored record is the response object (what ``GET /v1/responses/{id}`` returns)
and the conversation's items so far (its input items, expanded, followed by its output items):
a follow-up naming it in ``previous_response_id`` is sent to any model replica with those items
as its input (:func:`expand`).

Where it lives: one small named Ray actor (``raystack-responses``, detached, zero CPU, restarted
by Ray), as the quota counter does (:mod:`serving.gateway.admission.quota`): every gateway
replica reaches it, so a record outlives the replica that wrote it. Each record is also written
through to a key-value store (:class:`serving.contract.KV`; Ray's GCS, which GCS fault tolerance
keeps in Redis) under ``responses/<tenant>/<id>``, and a restarted actor reloads them.

Bounds (per tenant, :class:`serving.config.ResponseStoreConfig`): records expire ``ttl_s`` after
they are written; beyond ``max_per_tenant`` records or ``max_bytes_per_tenant`` bytes the oldest
go first; a record larger than ``max_response_bytes`` is not kept. Records are keyed by tenant,
so a tenant asking for another tenant's id gets the same 404 as for an unknown id.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from typing import Any

import msgspec

from serving.config import ResponseStoreConfig
from serving.errors import Unavailable, unavailable
from serving.gateway.admission.quota import ON_HEAD

logger = logging.getLogger("serving.gateway")

__all__ = ["PREFIX", "ResponseLog", "ResponseStore", "ResponseStoreActor", "expand", "input_items"]

PREFIX = "responses/"


class ResponseLog:
    """Per-tenant records in write order, with their expiry, bounded in count and bytes.
    Pure; the clock is passed in."""

    def __init__(self) -> None:
        self._tenants: dict[str, OrderedDict[str, tuple[float, bytes]]] = {}
        self._bytes: dict[str, int] = {}

    def put(
        self, tenant: str, rid: str, value: bytes, expires: float, max_items: int, max_bytes: int
    ) -> list[str] | None:
        """Keep ``value``; returns the ids evicted to make room (oldest first), or None when
        ``value`` alone is over ``max_bytes`` (then nothing is kept and nothing evicted)."""
        if len(value) > max_bytes:
            return None
        log = self._tenants.setdefault(tenant, OrderedDict())
        self.delete(tenant, rid)
        log[rid] = (expires, value)
        self._bytes[tenant] = self._bytes.get(tenant, 0) + len(value)
        evicted: list[str] = []
        while log and (len(log) > max_items or self._bytes[tenant] > max_bytes):
            old, _ = next(iter(log.items()))
            self.delete(tenant, old)
            evicted.append(old)
        return evicted

    def get(self, tenant: str, rid: str, now: float) -> bytes | None:
        log = self._tenants.get(tenant)
        entry = log.get(rid) if log is not None else None
        if entry is None or entry[0] <= now:
            return None
        return entry[1]

    def delete(self, tenant: str, rid: str) -> bool:
        entry = self._tenants.get(tenant, OrderedDict()).pop(rid, None)
        if entry is None:
            return False
        self._bytes[tenant] -= len(entry[1])
        return True

    def expired(self, now: float) -> list[tuple[str, str]]:
        """Drop and return every (tenant, id) whose time is up."""
        gone = [(t, r) for t, log in self._tenants.items() for r, (exp, _) in log.items() if exp <= now]
        for t, r in gone:
            self.delete(t, r)
        return gone

    def count(self, tenant: str) -> int:
        return len(self._tenants.get(tenant, ()))


def _key(tenant: str, rid: str) -> str:
    return f"{PREFIX}{tenant}/{rid}"


class ResponseStoreActor:
    """The shared store as a Ray actor (module docstring). ``kv``: Ray's key-value store when None.
    Expired records are swept every ``sweep_s`` (and never returned once expired)."""

    def __init__(self, kv: Any = None, sweep_s: float = 60.0) -> None:
        if kv is None:
            from serving.contract import RayKV

            kv = RayKV()
        self._kv, self._lock = kv, threading.Lock()
        self.log = ResponseLog()
        loaded: list[tuple[float, str, str, bytes]] = []
        for key, raw in kv.scan(PREFIX).items():
            tenant, _, rid = key.removeprefix(PREFIX).rpartition("/")
            head, _, value = raw.partition(b"\n")
            try:
                loaded.append((float(head), tenant, rid, value))
            except ValueError:
                logger.warning("ignoring an unreadable stored response %s", key)
        for expires, tenant, rid, value in sorted(loaded):
            self.log.put(tenant, rid, value, expires, 1 << 62, 1 << 62)  # bounds apply at the next put
        if sweep_s > 0:
            threading.Thread(target=self._sweep_forever, args=(sweep_s,), daemon=True).start()

    def put(self, tenant: str, rid: str, value: bytes, ttl_s: float, max_items: int, max_bytes: int) -> bool:
        """Whether ``value`` is kept (not when it alone is over ``max_bytes``)."""
        expires = time.time() + ttl_s
        with self._lock:
            evicted = self.log.put(tenant, rid, value, expires, max_items, max_bytes)
        if evicted is None:
            return False
        self._kv.put(_key(tenant, rid), f"{expires:.3f}\n".encode() + value)
        for old in evicted:
            self._kv.delete(_key(tenant, old))
        return True

    def get(self, tenant: str, rid: str) -> bytes | None:
        with self._lock:
            return self.log.get(tenant, rid, time.time())

    def delete(self, tenant: str, rid: str) -> bool:
        with self._lock:
            found = self.log.delete(tenant, rid)
        if found:
            self._kv.delete(_key(tenant, rid))
        return found

    def sweep(self) -> int:
        with self._lock:
            gone = self.log.expired(time.time())
        for tenant, rid in gone:
            self._kv.delete(_key(tenant, rid))
        return len(gone)

    def _sweep_forever(self, period_s: float) -> None:
        while True:
            time.sleep(period_s)
            try:
                self.sweep()
            except Exception as exc:  # noqa: BLE001 - keep serving; the next sweep may succeed
                logger.warning("response store sweep failed: %s", exc)


class ResponseStore:
    """Gateway side of the store. ``actor``: anything with the actor's remote methods (made on
    first use when None). A store that does not answer within ``timeout_s`` is a 503 for reads;
    a write that fails is logged and the response is still returned, unstored."""

    ACTOR_NAME, NAMESPACE = "raystack-responses", "raystack"

    def __init__(self, config: ResponseStoreConfig, actor: Any = None, metrics: Any = None) -> None:
        self.config, self._actor, self.metrics = config, actor, metrics

    def _handle(self) -> Any:
        if self._actor is None:
            import ray

            self._actor = (
                ray.remote(ResponseStoreActor)
                .options(
                    name=self.ACTOR_NAME,
                    namespace=self.NAMESPACE,
                    lifetime="detached",
                    get_if_exists=True,
                    num_cpus=0,
                    resources=ON_HEAD,
                    max_restarts=-1,
                    max_task_retries=-1,
                )
                .remote()
            )
        return self._actor

    async def _call(self, op: str, method: str, *args: Any) -> Any:
        handle = self._actor if self._actor is not None else await asyncio.to_thread(self._handle)
        try:
            return await asyncio.wait_for(getattr(handle, method).remote(*args), self.config.timeout_s)
        except Exception as exc:  # noqa: BLE001 - timeout, actor dead or restarting
            if type(exc).__name__ == "ActorDiedError":
                self._actor = None
            self._count(op, "", "error")
            logger.warning("response store %s failed: %s", op, type(exc).__name__)
            raise unavailable("The response store is unavailable; retry shortly.") from None

    def _count(self, op: str, tenant: str, result: str) -> None:
        if self.metrics is not None:
            self.metrics.response_store.inc(tags={"op": op, "tenant": tenant, "result": result})

    async def put(self, tenant: str, rid: str, record: dict[str, Any]) -> bool:
        value = msgspec.json.encode(record)
        c = self.config
        if len(value) > c.max_response_bytes:
            self._count("put", tenant, "too_large")
            logger.warning("response %s of tenant %s is over max_response_bytes: not stored", rid, tenant)
            return False
        try:
            kept = await self._call("put", "put", tenant, rid, value, c.ttl_s, c.max_per_tenant, c.max_bytes_per_tenant)
        except Unavailable:
            return False
        self._count("put", tenant, "ok" if kept else "too_large")
        return bool(kept)

    async def get(self, tenant: str, rid: str) -> dict[str, Any] | None:
        raw = await self._call("get", "get", tenant, rid)
        self._count("get", tenant, "ok" if raw is not None else "missing")
        if raw is None:
            return None
        record: dict[str, Any] = msgspec.json.decode(raw)
        return record

    async def delete(self, tenant: str, rid: str) -> bool:
        found = bool(await self._call("delete", "delete", tenant, rid))
        self._count("delete", tenant, "ok" if found else "missing")
        return found


def input_items(value: object) -> list[Any]:
    """A Responses ``input`` as a list of items (a string is one user message)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return list(value) if isinstance(value, list) else []


def expand(body: dict[str, Any], previous: dict[str, Any] | None) -> tuple[dict[str, Any], list[Any]]:
    """The body to forward (the previous conversation's items, then this request's input; no
    ``previous_response_id``; vLLM's store off) and the input items it carries."""
    items = list(previous["items"]) if previous else []
    items += input_items(body.get("input"))
    out = {k: v for k, v in body.items() if k != "previous_response_id"}
    out["input"], out["store"] = items, False
    return out, items
