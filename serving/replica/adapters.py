"""LoRA adapters on one base replica: which are registered with its engine, and when.

The base deployment's Serve ``user_config`` lists the adapter versions it may serve, each under
its own name ``name@version`` with its store path (:func:`serving.control.serve_config.adapter_sources`),
so adding, promoting or removing an adapter reconfigures running replicas instead of restarting them.

An adapter is registered on first use: Ray Serve's model multiplexing (``serve.multiplexed``,
:mod:`serving.replica.adapter_slots`) calls :meth:`AdapterSet.load` for a lease that names
an adapter this replica does not hold, keeps at most ``max_cpu_loras`` per replica and hands the
least recently used one to :meth:`AdapterSet.retire` to make room (requests the gateways send
straight to the engine reach that LRU through :meth:`AdapterSet.in_use`, read from the engine's
metrics every second); it also tells Serve's router which replica holds which adapter.
The multiplexer evicts that LRU adapter *before* it calls the load, so everything that can refuse
an adapter runs first, taking no slot (:meth:`AdapterSet.admit`): it must be configured for this
base and not refused lately, and the version is fetched into the node cache and every file
verified against its manifest (:class:`serving.node_cache.VerifiedCache`, like any version); a
rank above the engine's ``--max-lora-rank`` is refused, and so is an adapter whose manifest
records a base manifest hash (``base.manifest_sha256``) other than the hash of the base version
this replica serves. :meth:`load` then registers the verified local folder through vLLM's
``/v1/load_lora_adapter``. vLLM allows that route only with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, which it calls unsafe for production because anyone who
reaches the server could load weights: here the engine listens on a private port and the guard
middleware requires the replica's token on that route as on every other
(:mod:`serving.replica.engine_guard`); only this module calls it. (vLLM's LoRA resolver plugins
would run inside the engine process, which holds no store credentials and verifies nothing.)

A retired adapter leaves the replica's published record at once (gateways stop sending it there
within ``REFRESH_S``) and is unregistered ``UNLOAD_DELAY_S`` later (one wanted again before that
is kept, and counted as a load like any other); vLLM finishes the requests
it already holds either way (unregistering only removes the name). A gateway that could not read
the records meanwhile may still send the adapter here: the engine answers 404 (``The model
`name@version` does not exist``), which the gateway retries on another replica or through Serve's
router (:func:`serving.gateway.leases.adapter_missing`). Within the registered set, vLLM's own LRU
decides which adapters occupy its ``max_loras`` batch slots.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import httpx

from serving.config import LoraSlots
from serving.contract import REFRESH_S, AdapterRefused
from serving.metrics import samples
from serving.node_cache import VerifiedCache
from serving.registry import RegistryError

logger = logging.getLogger("ray.serve")

__all__ = ["ADMITTED_S", "REFUSED_S", "UNLOAD_DELAY_S", "AdapterRefused", "AdapterSet", "AdapterUnknown", "Registered"]

UNLOAD_DELAY_S = 2 * REFRESH_S + 1.0
REFUSED_S = 30.0  # an adapter that failed verification is refused this long without fetching it again
ADMITTED_S = 30.0  # a load this soon after admit() registers the folder admit() verified without verifying again


class AdapterUnknown(RuntimeError):
    """The adapter is not (yet) in this replica's configuration: another replica, or this one after
    its next reconfiguration, may hold it, so the gateway tries again (a replica-level refusal)."""


class Registered:
    """What the multiplexer caches for one adapter; its eviction retires the adapter."""

    def __init__(self, adapters: AdapterSet, name: str, loop: asyncio.AbstractEventLoop) -> None:
        self.adapters, self.name, self._loop, self._done = adapters, name, loop, False

    def __del__(self) -> None:
        # Serve's multiplexer calls this on eviction (in a thread); the garbage collector may again
        if not self._done:
            self._done = True
            try:
                self._loop.call_soon_threadsafe(self.adapters.retire, self.name)
            except RuntimeError:  # the replica's loop is closed: it is stopping anyway
                pass


class AdapterSet:
    """The adapters registered with one replica's engine, and the ones it may register."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        url: str,
        slots: LoraSlots,
        on_change: Callable[[], None],
        tags: dict[str, str],
        cache_dir: str | None = None,
        base_sha256: str | None = None,
    ) -> None:
        self.client, self.url, self.slots = client, url, slots
        self.on_change, self.tags, self.cache_dir = on_change, tags, cache_dir
        # the sha256 of the served base version's manifest bytes (None: unknown, not compared)
        self.base_sha256 = base_sha256
        self.allowed: dict[str, str] = {}  # name@version -> store path of the version
        self.pins: dict[str, str] = {}  # name@version -> sha256 its manifest must have (where pinned)
        self.registered: dict[str, str] = {}  # name@version -> verified local folder, registered now
        self._retiring: dict[str, asyncio.Task[None]] = {}
        self._refused: dict[str, tuple[str, float, str]] = {}  # name -> (store path#pin, refused until, why)
        self._admitted: dict[str, tuple[str, float, str]] = {}  # name -> (store path#pin, verified at, folder)
        self._seen_at = 0.0  # the newest lora_requests_info stamp read (the engine's clock)
        self._metrics: Any = None
        try:
            from serving.metrics import AdapterMetrics

            self._metrics = AdapterMetrics()
        except Exception:  # noqa: BLE001 - outside Ray (unit use): no metrics
            self._metrics = None

    @property
    def names(self) -> tuple[str, ...]:
        """The adapters gateways may send here now (registered, not retiring)."""
        return tuple(sorted(n for n in self.registered if n not in self._retiring))

    def holds(self, name: str) -> bool:
        return name in self.registered and name not in self._retiring

    def configure(self, allowed: dict[str, str], pins: dict[str, str] | None = None) -> None:
        """The adapter versions of the base's ``user_config`` (and their manifests' pins); registered
        ones no longer in it retire."""
        self.allowed, self.pins = dict(allowed), dict(pins or {})
        for name in [n for n in self.registered if n not in allowed]:
            self.retire(name)

    def _source(self, name: str) -> str:
        return f"{self.allowed[name]}#{self.pins.get(name, '')}"

    async def admit(self, name: str) -> None:
        """Everything that can refuse ``name`` but vLLM itself, before a registration takes a slot:
        Serve's multiplexer evicts its least recently used adapter before it calls :meth:`load`, so
        a refusal there would cost a healthy adapter. Raises :class:`AdapterUnknown` (not
        configured for this base) or :class:`AdapterRefused` (files, rank, base); the verified
        folder is what the next :meth:`load` of ``name`` registers, without verifying it again."""
        local = await self._admit(name)
        if local is not None:
            self._admitted[name] = (self._source(name), time.monotonic(), local)

    async def _admit(self, name: str) -> str | None:
        """The verified local folder of ``name`` (None: registered already), or why not."""
        if name not in self.allowed:
            raise AdapterUnknown(f"adapter {name!r} is not configured for this base")
        if name in self.registered:  # held (or retiring, kept if wanted again): nothing to verify
            return None
        source = self._source(name)
        refused = self._refused.get(name)
        if refused is not None and refused[0] == source and time.monotonic() < refused[1]:
            raise AdapterRefused(refused[2])
        try:
            local = await asyncio.to_thread(self._verified, name)
        except AdapterRefused as exc:  # the same files would be refused again: not refetched for a while
            self._refused[name] = (source, time.monotonic() + REFUSED_S, str(exc))
            raise
        return local

    async def load(self, name: str, handle: Registered | None = None) -> Registered:
        """Register ``name`` with the engine (admitted first, see :meth:`admit`) unless it holds it.
        With ``handle``, the one Serve's multiplexer still caches for ``name`` (retired meanwhile by
        a configuration change), that handle owns the registration again and is returned."""
        if name not in self.allowed:
            raise AdapterUnknown(f"adapter {name!r} is not configured for this base")
        retiring = self._retiring.pop(name, None)
        if retiring is not None:  # wanted again before it was unregistered: kept, still a load
            retiring.cancel()
            self._count("loads", name)
        elif name not in self.registered:
            admitted = self._admitted.pop(name, None)
            local = admitted[2] if admitted is not None else None
            if admitted is None or admitted[0] != self._source(name) or time.monotonic() - admitted[1] > ADMITTED_S:
                local = await self._admit(name)  # not admitted (a direct load), or since changed
            assert local is not None  # not registered: nothing awaited since that was checked
            body = {"lora_name": name, "lora_path": local}
            resp = await self.client.post(f"{self.url}/v1/load_lora_adapter", json=body, timeout=120)
            # vLLM still holds the name when an unregistration of it never reached the engine (timed
            # out): the same verified version, registered already. (Not loaded in place: vLLM keeps
            # the flag on the adapter and would then reload its files at every engine step.)
            held = resp.status_code == 400 and "already been loaded" in resp.text
            if resp.status_code != 200 and not held:
                raise AdapterRefused(f"vLLM refused adapter {name!r}: {resp.status_code} {resp.text[:300]}")
            self.registered[name] = local
            logger.info("adapter %s registered (%d held)", name, len(self.registered))
            self._count("loads", name)
        self.on_change()
        if handle is None:
            return Registered(self, name, asyncio.get_running_loop())
        if handle._done:  # the multiplexer evicted it meanwhile: nothing owns the registration now
            self.retire(name)
        return handle

    def _verified(self, name: str) -> str:
        try:
            resolved = VerifiedCache(self.cache_dir).resolve_uri(self.allowed[name], self.pins.get(name))
        except (RegistryError, OSError, ValueError) as exc:  # tampered, partial, unreadable: named
            raise AdapterRefused(f"{name}: {exc}") from None
        adapter = resolved.manifest.adapter
        if adapter is None:
            raise AdapterRefused(f"{name}: the version's manifest describes no LoRA adapter")
        if adapter.rank > self.slots.max_lora_rank:
            raise AdapterRefused(
                f"{name}: rank {adapter.rank} exceeds the base's max_lora_rank {self.slots.max_lora_rank}"
            )
        # As the deploy checks (serving.control.bases.check_base_manifest): a base manifest hash the
        # adapter's manifest records must be the served base's; one that records none is accepted.
        trained = resolved.manifest.base
        recorded = trained.manifest_sha256 if trained is not None else None
        if trained is not None and recorded and self.base_sha256 and recorded != self.base_sha256:
            raise AdapterRefused(
                f"{name}: trained on {trained.ref} (manifest sha256 {recorded}), but this replica serves "
                f"{self.tags.get('model', '?')}@{self.tags.get('version', '?')} (manifest sha256 {self.base_sha256})"
            )
        return resolved.path

    def retire(self, name: str) -> None:
        """Stop publishing ``name`` now; unregister it from the engine ``UNLOAD_DELAY_S`` later."""
        if name in self.registered and name not in self._retiring:
            self._retiring[name] = asyncio.get_running_loop().create_task(self._unload_later(name))
            self.on_change()

    async def _unload_later(self, name: str) -> None:
        await asyncio.sleep(UNLOAD_DELAY_S)
        self._retiring.pop(name, None)
        self.registered.pop(name, None)
        try:
            await self.client.post(f"{self.url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=30)
        except httpx.HTTPError as exc:  # the engine is going away: nothing left to unregister
            logger.warning("unregistering adapter %s: %s", name, exc)
        self._count("evictions", name)
        logger.info("adapter %s unregistered (%d held)", name, len(self.registered))

    def in_use(self, metrics_text: str) -> list[str]:
        """Held adapters the engine ran or queued since the last call, from its ``/metrics``:
        vLLM stamps the current time on ``vllm:lora_requests_info`` for the running and waiting
        adapters of each step (a series per combination), so every series stamped since the last
        read names adapters in use. Requests a gateway sent directly count there too, which the
        multiplexer's LRU would not see otherwise."""
        used: set[str] = set()
        newest = self._seen_at
        for _, labels, stamp in samples(metrics_text, "lora_requests_info", {"vllm:lora_requests_info"}):
            if stamp > self._seen_at:
                newest = max(newest, stamp)
                for key in ("running_lora_adapters", "waiting_lora_adapters"):
                    used.update(n for n in labels.get(key, "").split(",") if n)
        self._seen_at = newest
        return sorted(n for n in used if self.holds(n))

    def leased(self, name: str, hit: bool) -> None:
        """A lease for ``name`` reached this replica, holding the adapter already (hit) or not."""
        if self._metrics is not None:
            self._metrics.leases.inc(tags={**self.tags, "adapter": name, "outcome": "hit" if hit else "miss"})

    def _count(self, what: str, name: str) -> None:
        m = self._metrics
        if m is not None:
            getattr(m, what).inc(tags={**self.tags, "adapter": name})
            m.registered.set(len(self.names), tags=self.tags)
