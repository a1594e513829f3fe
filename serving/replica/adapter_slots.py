"""A base replica's adapter slots: Ray Serve's multiplexer over :class:`AdapterSet`, and what a lease
for an adapter does before the request is sent (:mod:`serving.replica.adapters` says why).

Serve's multiplexer (``ray.serve.multiplex._ModelMultiplexWrapper.load_model``) evicts its least
recently used adapter *before* it calls the load function, under its cache lock, and never puts
back what it evicted when that load raises. So :func:`register` admits the adapter first
(:meth:`AdapterSet.admit`: configured, not refused lately, files verified, rank and base checked),
taking no slot; the load the multiplexer then calls only posts to vLLM.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from serving.manifest import MANIFEST, manifest_sha256
from serving.replica.adapters import AdapterSet, Registered
from serving.replica.engine import EngineSpec

__all__ = ["base_manifest_sha256", "multiplexed", "register"]

Multiplexed = Callable[[str], Awaitable[Registered]]


def base_manifest_sha256(spec: EngineSpec) -> str:
    """The served version's identity, as an adapter's manifest records it (``base.manifest_sha256``):
    the sha256 of its manifest's bytes -- the pin where the spec has one (the verified manifest's
    bytes hash to it), else of ``manifest.json`` in the verified local folder ``spec.path``."""
    return spec.manifest_sha256 or manifest_sha256((Path(spec.path) / MANIFEST).read_bytes())


def multiplexed(adapters: AdapterSet, per_replica: int) -> Any:
    """Ray Serve's multiplexed loader over ``adapters``: at most ``per_replica`` held, the least
    recently used evicted (``Registered.__del__``), and the held ids reported to Serve's router."""
    from ray import serve

    async def load(name: str) -> Registered:
        return await adapters.load(name)

    return serve.multiplexed(max_num_models_per_replica=per_replica)(load)


async def register(adapters: AdapterSet, mux: Multiplexed, name: str) -> None:
    """``name`` registered with the engine (or refused) before a lease's request is sent here."""
    held = adapters.holds(name)
    adapters.leased(name, held)
    if not held:  # refused or unknown here, not after the multiplexer evicted a healthy adapter
        await adapters.admit(name)
    handle = await mux(name)
    if not adapters.holds(name):
        # The multiplexer still caches a handle for an adapter a configuration change retired (it
        # hits, so it calls no load). Registered again under that same handle rather than a new
        # one: a new handle nothing keeps would retire it when collected, and the cached one would
        # retire it again when the multiplexer evicts it. Serve has no public way to drop one id
        # from its cache (only its LRU eviction, under its lock), so its entry is reused, not removed.
        await adapters.load(name, handle)
