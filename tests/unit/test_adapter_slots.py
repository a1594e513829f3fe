"""A base replica's adapter slots through Ray Serve's own multiplexer (its metrics, pusher and
replica context stubbed: no Ray started) against a scripted vLLM: a lease refused or unknown here
evicts no healthy adapter, one re-registered after a configuration change stays registered and
published, and one trained on other base weights is refused before vLLM loads it."""

from __future__ import annotations

import asyncio
import gc
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from serving.config import EngineConfig, LoraSlots
from serving.manifest import manifest_sha256
from serving.replica import adapters as adapters_mod
from serving.replica.adapter_slots import base_manifest_sha256
from serving.replica.adapters import AdapterRefused, AdapterSet, AdapterUnknown
from serving.replica.engine import EngineSpec
from serving.replica.server import ModelServer
from tests.unit.test_adapters import TAGS, _Engine, _publish_adapter
from tests.unit.test_controller import _publish


class _Stub:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


@pytest.fixture
def serve_mux(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``serve.multiplexed(max_num_models_per_replica=n)(load)``, as the replica builds it, and its
    cache (an OrderedDict of model id -> handle, least recently used first)."""
    import ray.serve.multiplex as mx
    from ray import serve

    monkeypatch.setattr(mx, "metrics", SimpleNamespace(Histogram=_Stub, Gauge=_Stub, Counter=_Stub))
    monkeypatch.setattr(mx, "MetricsPusher", _Stub)
    monkeypatch.setattr(mx, "_get_global_client", _Stub)
    ctx = SimpleNamespace(app_name="calc--v1", deployment="calc--v1", replica_id="r1")
    monkeypatch.setattr(mx, "_get_internal_replica_context", lambda: ctx)
    monkeypatch.setattr(adapters_mod, "UNLOAD_DELAY_S", 0.05)

    def build(held: AdapterSet, per_replica: int) -> tuple[Any, Any]:
        async def load(name: str) -> adapters_mod.Registered:
            return await held.load(name)

        mux = serve.multiplexed(max_num_models_per_replica=per_replica)(load)
        return mux, lambda: list(getattr(load, "__serve_multiplex_wrapper").models)

    return build


def _held(engine: _Engine, tmp_path: Path, slots: LoraSlots, base_sha256: str | None = None) -> AdapterSet:
    client = httpx.AsyncClient(transport=httpx.MockTransport(engine))
    kwargs = {"base_sha256": base_sha256} if base_sha256 else {}
    return AdapterSet(client, "http://e", slots, lambda: None, TAGS, cache_dir=str(tmp_path / "cache"), **kwargs)


async def test_a_refused_or_unknown_adapter_evicts_no_healthy_one(tmp_path: Path, serve_mux: Any) -> None:
    for name, rank in (("sub", 8), ("tax", 8), ("big", 64), ("bad", 8), ("new", 8)):
        _publish_adapter(tmp_path, name, "v1", "calc@v1", rank=rank)
    (tmp_path / "bad" / "v1" / "adapter_model.safetensors").write_bytes(b"tampered")
    engine = _Engine()
    held = _held(engine, tmp_path, LoraSlots(max_lora_rank=16, max_loras=2, max_cpu_loras=2))
    held.configure({f"{n}@v1": str(tmp_path / n / "v1") for n in ("sub", "tax", "big", "bad", "new")})
    mux, cached = serve_mux(held, 2)
    server = SimpleNamespace(adapters=held, _adapter=mux)
    await ModelServer._register(server, "sub@v1")  # type: ignore[arg-type]
    await ModelServer._register(server, "tax@v1")  # type: ignore[arg-type]
    refusals: list[tuple[str, type[Exception], str]] = [
        ("big@v1", AdapterRefused, "rank 64 exceeds the base's max_lora_rank 16"),
        ("bad@v1", AdapterRefused, "adapter_model.safetensors"),
        ("bad@v1", AdapterRefused, "adapter_model.safetensors"),  # refused again from the refusal cache
        ("other@v1", AdapterUnknown, "not configured"),
    ]
    for name, error, message in refusals:
        with pytest.raises(error, match=message):
            await ModelServer._register(server, name)  # type: ignore[arg-type]
        await asyncio.sleep(0.1)  # an eviction would have unregistered by now
        assert held.names == ("sub@v1", "tax@v1") and cached() == ["sub@v1", "tax@v1"], name
    await ModelServer._register(server, "new@v1")  # a loadable one still evicts the least recently used
    await asyncio.sleep(0.1)
    assert held.names == ("new@v1", "tax@v1") and cached() == ["tax@v1", "new@v1"]
    assert [(path.rsplit("/", 1)[1], name) for path, name in engine.calls] == [
        ("load_lora_adapter", "sub@v1"),
        ("load_lora_adapter", "tax@v1"),
        ("load_lora_adapter", "new@v1"),
        ("unload_lora_adapter", "sub@v1"),
    ]


async def test_an_adapter_registered_again_after_a_config_change_stays_registered(
    tmp_path: Path, serve_mux: Any
) -> None:
    for name in ("sub", "tax", "new"):
        _publish_adapter(tmp_path, name, "v1", "calc@v1")
    engine = _Engine()
    published: list[tuple[str, ...]] = []
    held = _held(engine, tmp_path, LoraSlots(max_loras=2, max_cpu_loras=2))
    held.on_change = lambda: published.append(held.names)
    config = {f"{n}@v1": str(tmp_path / n / "v1") for n in ("sub", "tax", "new")}
    held.configure(config)
    mux, cached = serve_mux(held, 2)
    server = SimpleNamespace(adapters=held, _adapter=mux)
    await ModelServer._register(server, "sub@v1")  # type: ignore[arg-type]
    held.configure({})  # a rollback removes it: retired while Serve's multiplexer still caches it
    await asyncio.sleep(0.1)
    held.configure(config)  # promoted again
    for _ in range(3):  # leases for it: the multiplexer hits its cached handle
        await ModelServer._register(server, "sub@v1")  # type: ignore[arg-type]
        gc.collect()
        await asyncio.sleep(0.1)
        assert held.holds("sub@v1") and held.names == ("sub@v1",) and published[-1] == ("sub@v1",)
    assert [p.rsplit("/", 1)[1] for p, _ in engine.calls] == ["load_lora_adapter", "unload_lora_adapter"] + [
        "load_lora_adapter"
    ]
    # the multiplexer's cached handle owns the registration again: its eviction retires it, once
    await ModelServer._register(server, "tax@v1")  # type: ignore[arg-type]
    await ModelServer._register(server, "new@v1")  # type: ignore[arg-type]
    await asyncio.sleep(0.1)
    assert held.names == ("new@v1", "tax@v1") and cached() == ["tax@v1", "new@v1"]
    assert [c for c in engine.calls if c[1] == "sub@v1"][-1] == ("/v1/unload_lora_adapter", "sub@v1")
    assert len([c for c in engine.calls if c[0].endswith("/unload_lora_adapter")]) == 2


async def test_an_adapter_trained_on_other_base_weights_is_refused_before_vllm_loads_it(tmp_path: Path) -> None:
    _publish(tmp_path, "calc", "v1")
    base = tmp_path / "calc" / "v1"
    served = manifest_sha256((base / "manifest.json").read_bytes())
    _publish_adapter(tmp_path, "sub", "v1", "calc@v1", base_sha=served)
    _publish_adapter(tmp_path, "sub", "v2", "calc@v1", base_sha="0" * 64)  # calc@v1 was re-published since
    _publish_adapter(tmp_path, "sub", "v3", "calc@v1")  # no base hash recorded: the deploy compared the name
    engine = _Engine()
    held = _held(engine, tmp_path, LoraSlots(), base_sha256=served)
    held.configure({f"sub@{v}": str(tmp_path / "sub" / v) for v in ("v1", "v2", "v3")})
    with pytest.raises(AdapterRefused, match=f"trained on calc@v1 \\(manifest sha256 {'0' * 64}\\).*{served}"):
        await held.admit("sub@v2")
    with pytest.raises(AdapterRefused, match="trained on calc@v1"):
        await held.load("sub@v2")  # a direct load checks the same
    handles = [await held.load("sub@v1"), await held.load("sub@v3")]  # kept, as the multiplexer keeps them
    assert [h.name for h in handles] == ["sub@v1", "sub@v3"] and held.names == ("sub@v1", "sub@v3")
    assert engine.calls == [("/v1/load_lora_adapter", "sub@v1"), ("/v1/load_lora_adapter", "sub@v3")]

    spec = EngineSpec(model="calc", version="v1", path=str(base), engine=EngineConfig())
    assert base_manifest_sha256(spec) == served  # the verified folder's manifest bytes
    pinned = spec.model_copy(update={"manifest_sha256": served})
    (base / "manifest.json").write_text(json.dumps({"not": "read"}))
    assert base_manifest_sha256(pinned) == served  # the pin the verified manifest hashed to
