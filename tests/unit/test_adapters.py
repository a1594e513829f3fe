"""LoRA adapters as model entries: config rules, what the Serve config deploys for them, the
gateway's choice of a base replica that holds one, a replica's registrations (against a scripted
vLLM answer; the real engine is in tests/integration/test_adapters.py) and the controller's rule
for base versions that adapters still run on."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from serving.config import ConfigError, LoraSlots, parse_config
from serving.contract import Record
from serving.control.serve_config import adapter_bases, build_serve_config, serving_app
from serving.gateway.replicas import EndpointTable
from serving.node_cache import VerifiedCache
from serving.record import PromotionRequest
from serving.registry import hash_tree
from serving.replica import adapters as adapters_mod
from serving.replica.adapters import AdapterRefused, AdapterSet, AdapterUnknown
from serving.replica.engine import EngineSpec, vllm_command, vllm_env
from tests.unit.test_controller import POLICY, Clock, Cluster, _controller, _publish, _run

TAGS = {"model": "calc", "version": "v1", "replica": "r1"}


def _stack(root: Path, adapters: list[dict[str, Any]] | None = None, **base: Any) -> dict[str, Any]:
    return {
        "name": "t",
        "auth": {"mode": "open"},
        "checkpoint_root": str(root),
        "models": [
            {"name": "calc", "versions": [{"version": "v1"}], **base},
            *(adapters if adapters is not None else [{"name": "sub", "base": "calc", "versions": [{"version": "v1"}]}]),
        ],
    }


def _publish_adapter(
    root: Path, model: str, version: str, base: str, rank: int = 8, base_sha: str | None = None
) -> Path:
    d = root / model / version
    d.mkdir(parents=True)
    (d / "adapter_config.json").write_text(json.dumps({"r": rank, "base_model_name_or_path": base}))
    (d / "adapter_model.safetensors").write_bytes(b"weights " + version.encode())
    manifest = {
        "model": model,
        "version": version,
        "base": {"source": "store", "ref": base, **({"manifest_sha256": base_sha} if base_sha else {})},
        "adapter": {"rank": rank, "alpha": 16, "target_modules": ["q_proj"]},
        "eval": {"metrics": {"exact_match": 0.9}, "n": 10},
        "files": hash_tree(d),
        "created_at": "2026-11-30T00:00:00Z",
    }
    (d / "manifest.json").write_text(json.dumps(manifest))
    return d


def test_an_adapter_entry_names_a_generating_base_and_leaves_engine_and_slots_to_it(tmp_path: Path) -> None:
    cfg = parse_config(_stack(tmp_path))
    assert cfg.lora_slots(cfg.model("calc")) == LoraSlots()  # derived: an adapter names it
    assert cfg.model("sub").is_adapter and cfg.adapters_of(cfg.model("calc")) == [cfg.model("sub")]
    bad = [
        ({"name": "sub", "base": "nope", "versions": [{"version": "v1"}]}, "must be a generating model"),
        ({"name": "sub", "base": "calc", "engine": {"max_model_len": 64}, "versions": [{"version": "v1"}]}, "base's"),
        ({"name": "sub", "base": "calc", "lora": {}, "versions": [{"version": "v1"}]}, "base's ['lora']"),
    ]
    for entry, message in bad:
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            parse_config(_stack(tmp_path, [entry]))
    with pytest.raises(ConfigError, match="method lora belongs to an adapter"):
        recipe = {"base": "calc@v1", "data": "builtin:sub", "method": "lora"}
        parse_config(_stack(tmp_path, [], versions=[{"version": "v1", "recipe": recipe}]))
    with pytest.raises(ConfigError, match="max_cpu_loras must be at least max_loras"):
        parse_config(_stack(tmp_path, lora={"max_loras": 4, "max_cpu_loras": 2}))


def test_adapters_are_registered_on_their_trained_base_and_adding_one_restarts_nothing(tmp_path: Path) -> None:
    _publish_adapter(tmp_path, "sub", "v1", "calc@v1")
    cfg = parse_config(_stack(tmp_path, lora={"max_loras": 2, "max_cpu_loras": 3, "max_lora_rank": 8}))
    sc = build_serve_config(cfg, read_manifests=True)
    apps = {a["name"]: a for a in sc["applications"]}
    assert "sub--v1" not in apps  # an adapter has no application of its own
    (dep,) = apps["calc--v1"]["deployments"]
    assert dep["user_config"] == {"adapters": {"sub@v1": str(tmp_path / "sub" / "v1")}}
    spec = EngineSpec.model_validate(apps["calc--v1"]["args"]["spec"])
    cmd = " ".join(vllm_command(spec, "127.0.0.1", 9))
    assert "--enable-lora --max-loras 2 --max-cpu-loras 3 --max-lora-rank 8" in cmd
    assert vllm_env(spec)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    (route,) = [m for m in apps["gateway"]["deployments"][0]["user_config"]["models"] if m["name"] == "sub"]
    assert route["base"] == "calc" and route["versions"][0] | {"created": 0} == {
        "version": "v1", "weight": 100, "app": "calc--v1", "created": 0, "adapter": "sub@v1"
    }  # fmt: skip

    _publish_adapter(tmp_path, "tax", "v1", "calc@v1")
    more = _stack(tmp_path, [{"name": n, "base": "calc", "versions": [{"version": "v1"}]} for n in ("sub", "tax")])
    more["models"][0]["lora"] = {"max_loras": 2, "max_cpu_loras": 3, "max_lora_rank": 8}
    apps2 = {a["name"]: a for a in build_serve_config(parse_config(more), read_manifests=True)["applications"]}
    # the base's args (its engine flags) are unchanged: Serve reconfigures it in place
    assert apps2["calc--v1"]["args"] == apps["calc--v1"]["args"]
    assert sorted(apps2["calc--v1"]["deployments"][0]["user_config"]["adapters"]) == ["sub@v1", "tax@v1"]


def test_an_adapter_on_an_unserved_base_or_above_the_rank_is_refused(tmp_path: Path) -> None:
    _publish_adapter(tmp_path, "sub", "v1", "calc@v0")
    with pytest.raises(ConfigError, match=r"trained on calc@v0, which is not served \(calc serves v1\)"):
        build_serve_config(parse_config(_stack(tmp_path)), read_manifests=True)
    _publish_adapter(tmp_path, "big", "v1", "calc@v1", rank=32)
    stack = _stack(tmp_path, [{"name": "big", "base": "calc", "versions": [{"version": "v1"}]}])
    with pytest.raises(ConfigError, match=r"rank 32 exceeds models\[calc\].lora.max_lora_rank 16"):
        build_serve_config(parse_config(stack), read_manifests=True)
    # offline (no manifests): on the base's live version
    assert adapter_bases(parse_config(_stack(tmp_path))) == {("sub", "v1"): "v1"}
    assert serving_app(parse_config(_stack(tmp_path)), "sub", "v1") == "calc--v1"


def test_an_adapter_runs_on_its_base_checkpoint_served_under_another_name(tmp_path: Path) -> None:
    """sub@v1 was trained on calc@v1; calc-kv serves calc@v1's own folder (another router, say):
    sub may name calc-kv as its base, and runs on the version holding that checkpoint. A version
    of other weights is refused, and so is the same name at another version."""
    _publish(tmp_path, "calc", "v1")
    _publish(tmp_path, "calc", "v2")
    _publish_adapter(tmp_path, "sub", "v1", "calc@v1")
    stack = _stack(tmp_path, [{"name": "sub", "base": "calc-kv", "versions": [{"version": "v1"}]}])
    same = {"name": "calc-kv", "versions": [{"version": "v2", "weight": 0, "path": str(tmp_path / "calc" / "v2")},
                                            {"version": "v9", "path": str(tmp_path / "calc" / "v1")}]}  # fmt: skip
    stack["models"].append(same)
    cfg = parse_config(stack)
    bases = adapter_bases(cfg, read_manifests=True)
    assert bases == {("sub", "v1"): "v9"}
    assert serving_app(cfg, "sub", "v1", bases) == "calc-kv--v9"
    clock = Clock()
    (tmp_path / "ck").mkdir()
    assert _controller(tmp_path, stack, clock, Cluster(clock)).bases.version_for(cfg.model("sub"), "v1") == "v9"
    same["versions"] = [{"version": "v2", "path": str(tmp_path / "calc" / "v2")}]  # only calc@v2's weights
    with pytest.raises(ConfigError, match=r"not a LoRA adapter of 'calc-kv' \(its manifest's base is calc@v1\)"):
        build_serve_config(parse_config(stack), read_manifests=True)


def test_the_gateway_picks_a_replica_that_holds_the_adapter() -> None:
    table = EndpointTable()
    table.update(
        [
            Record("calc--v1", "r1", "http://r1", "t", 1, adapters=frozenset({"sub@v1"})),
            Record("calc--v1", "r2", "http://r2", "t", 1, adapters=frozenset({"tax@v1"})),
        ]
    )
    picked = [table.pick("calc--v1", adapter="sub@v1") for _ in range(6)]
    assert {p.replica for p in picked if p} == {"r1"}
    assert table.pick("calc--v1", adapter="new@v1") is None  # nobody holds it: Serve's router places it
    assert table.pick("calc--v1", limit=6, adapter="sub@v1") is None  # the holder is full


class _Engine:
    """vLLM's runtime LoRA routes as the replica calls them (the real ones: integration tests)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.calls.append((request.url.path, body["lora_name"]))
        return httpx.Response(200, text="Success")


def test_a_replica_verifies_registers_and_retires_adapters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adapters_mod, "UNLOAD_DELAY_S", 0.05)
    for name in ("sub", "tax", "big"):
        _publish_adapter(tmp_path, name, "v1", "calc@v1", rank=64 if name == "big" else 8)
    engine = _Engine()
    published: list[tuple[str, ...]] = []

    async def scenario() -> AdapterSet:
        client = httpx.AsyncClient(transport=httpx.MockTransport(engine))
        held = AdapterSet(client, "http://e", LoraSlots(max_lora_rank=16), lambda: published.append(held.names), TAGS,
                          cache_dir=str(tmp_path / "cache"))  # fmt: skip
        held.configure({f"{n}@v1": str(tmp_path / n / "v1") for n in ("sub", "tax", "big")})
        await held.load("sub@v1")
        await held.load("sub@v1")  # held: no second registration
        with pytest.raises(AdapterRefused, match="rank 64 exceeds the base's max_lora_rank 16"):
            await held.load("big@v1")
        with pytest.raises(AdapterUnknown, match="not configured"):
            await held.load("other@v1")
        await held.load("tax@v1")
        held.retire("sub@v1")
        assert held.names == ("tax@v1",)  # out of the published record at once
        await asyncio.sleep(0.2)
        held.configure({"tax@v1": str(tmp_path / "tax" / "v1")})  # still configured: kept
        held.configure({})
        await asyncio.sleep(0.2)
        with pytest.raises(AdapterUnknown, match="not configured"):
            await held.load("tax@v1")
        return held

    held = asyncio.run(scenario())
    assert engine.calls == [
        ("/v1/load_lora_adapter", "sub@v1"),
        ("/v1/load_lora_adapter", "tax@v1"),
        ("/v1/unload_lora_adapter", "sub@v1"),
        ("/v1/unload_lora_adapter", "tax@v1"),
    ]
    assert held.names == () and published[-1] == ()


class _StickyEngine(_Engine):
    """vLLM's answers when an unregistration never reached it: the name stays loaded, and a second
    load of it is refused with vLLM's 400."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded: set[str] = set()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.calls.append((request.url.path, body["lora_name"]))
        if request.url.path.endswith("/unload_lora_adapter"):
            raise httpx.ReadTimeout("busy engine", request=request)
        assert "load_inplace" not in body  # vLLM would reload an in-place adapter's files at every step
        if body["lora_name"] in self.loaded:
            message = f"The lora adapter '{body['lora_name']}' has already been loaded. If you want to load"
            return httpx.Response(400, json={"error": {"message": message, "type": "BadRequestError", "code": 400}})
        self.loaded.add(body["lora_name"])
        return httpx.Response(200, text="Success")


def test_an_adapter_whose_unregistration_failed_can_be_registered_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(adapters_mod, "UNLOAD_DELAY_S", 0.05)
    _publish_adapter(tmp_path, "sub", "v1", "calc@v1")
    engine = _StickyEngine()

    async def scenario() -> AdapterSet:
        client = httpx.AsyncClient(transport=httpx.MockTransport(engine))
        held = AdapterSet(client, "http://e", LoraSlots(), lambda: None, TAGS, cache_dir=str(tmp_path / "cache"))
        held.configure({"sub@v1": str(tmp_path / "sub" / "v1")})
        await held.load("sub@v1")
        held.retire("sub@v1")
        await asyncio.sleep(0.2)  # the unregistration timed out: the engine still holds it
        again = await held.load("sub@v1")  # kept: the multiplexer's handle
        assert held.names == ("sub@v1",) and again.name == "sub@v1"
        return held

    asyncio.run(scenario())
    assert [c[0].rsplit("/", 1)[1] for c in engine.calls] == [
        "load_lora_adapter",
        "unload_lora_adapter",
        "load_lora_adapter",
    ]


def test_a_tampered_adapter_is_never_registered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = _publish_adapter(tmp_path, "sub", "v1", "calc@v1")
    (d / "adapter_model.safetensors").write_bytes(b"tampered")
    engine = _Engine()

    async def scenario() -> None:
        client = httpx.AsyncClient(transport=httpx.MockTransport(engine))
        held = AdapterSet(client, "http://e", LoraSlots(), lambda: None, TAGS, cache_dir=str(tmp_path / "cache"))
        held.configure({"sub@v1": str(d)})
        with pytest.raises(AdapterRefused, match="sub@v1: .*adapter_model.safetensors"):
            await held.load("sub@v1")
        fetched = []
        monkeypatch.setattr(VerifiedCache, "resolve_uri", lambda *a: fetched.append(a))
        with pytest.raises(AdapterRefused, match="adapter_model.safetensors"):
            await held.load("sub@v1")  # refused again at once, without fetching and hashing it again
        assert fetched == []

    asyncio.run(scenario())
    assert engine.calls == []


async def test_a_refused_adapter_is_answered_once_not_retried_on_other_replicas() -> None:
    """The gateway's side: a lease that the replica refuses for its adapter (every replica would)
    is a clear error naming the adapter, not a replica failure to retry, and not a bare 500."""
    from serving.contract import LeaseHint
    from serving.errors import InternalError
    from serving.gateway.replicas import ReplicaFinder

    class Refusing:
        async def __anext__(self) -> object:
            raise AdapterRefused("sub@v1: adapter_model.safetensors does not match the manifest")

        def cancel(self) -> None:
            pass

    class Handle:
        class lease:  # noqa: N801 - mirrors handle.lease.remote(...)
            @staticmethod
            def remote(hint: LeaseHint) -> Refusing:
                return Refusing()

        def options(self, **kwargs: Any) -> Handle:
            return self

    leases = ReplicaFinder()
    leases._handles["calc--v1"] = Handle()  # type: ignore[assignment]
    with pytest.raises(InternalError) as err:
        await leases.lease("calc--v1", LeaseHint(adapter="sub@v1"), timeout_s=5)
    assert err.value.code == "adapter_refused" and "sub@v1" in err.value.message
    assert "safetensors" not in err.value.message  # the store's details stay in the gateway's log


class _Cluster(Cluster):
    def metrics_by_node(self) -> dict[str, str]:  # the same scripted traffic for the adapter
        (text,) = super().metrics_by_node().values()
        return {"node-1": text + "\n" + text.replace('model="calc"', 'model="sub"')}


def _calc_and_sub(tmp_path: Path) -> tuple[Path, Clock, _Cluster]:
    """A store with calc@v1 and its adapter sub@v1, and a scripted cluster."""
    root = tmp_path / "ck"
    root.mkdir()
    clock = Clock()
    _publish(root, "calc", "v1")
    _publish_adapter(root, "sub", "v1", "calc@v1")
    return root, clock, _Cluster(clock)


def test_a_base_version_stays_while_a_live_adapter_runs_on_it(tmp_path: Path) -> None:
    """calc v1 -> v2 keeps v1 at 0% for sub@v1 (trained on calc@v1); sub v1 -> v2 (trained on
    calc@v2) canaries on calc--v2 and, once promoted, calc@v1 is removed."""
    root, clock, cluster = _calc_and_sub(tmp_path)
    policy = {**POLICY, "mode": "manual"}
    cfg = _stack(root, [{"name": "sub", "base": "calc", "versions": [{"version": "v1"}], "promotion": policy}])
    cfg["models"][0] |= {"promotion": {**POLICY, "mode": "auto"}}
    ctl = _controller(tmp_path, cfg, clock, cluster)
    _publish(root, "calc", "v2")
    _run(ctl, clock, 40)
    assert cluster.weights("calc") == [("v2", 100), ("v1", 0)]
    assert ctl.control.history("calc")[-1].steps[-1].note == "promoted; v1 kept at 0% for the adapters trained on it"

    _publish_adapter(root, "sub", "v2", "calc@v2")
    _publish_adapter(root, "sub", "v3", "calc@v0")
    ctl.control.submit("sub", PromotionRequest(action="promote", version="v3", at=0))
    _run(ctl, clock, 1)
    assert "trained on calc@v0, which is not served (v2, v1)" in (ctl.control.history("sub")[-1].reason or "")
    cluster.status["calc--v2"] = ("DEPLOYING", "")  # sub@v2's app is its base's
    ctl.control.submit("sub", PromotionRequest(action="promote", version="v2", at=0))
    _run(ctl, clock, 3)
    assert ctl.control.active("sub") is not None and ctl.control.active("sub").status == "deploying"
    cluster.status.clear()
    _run(ctl, clock, 40)
    assert ctl.control.history("sub")[-1].status == "promoted"
    assert cluster.weights("sub") == [("v2", 100)] and cluster.weights("calc") == [("v2", 100)]
    assert cluster.warmed == ["calc@v2", "sub@v2"]


def test_adapters_the_engine_used_since_the_last_read_count_as_recently_used(tmp_path: Path) -> None:
    """vLLM stamps the time on one ``lora_requests_info`` series per running/waiting combination."""

    def text(*series: tuple[str, str, float]) -> str:
        lines = [
            f'vllm:lora_requests_info{{max_lora="2",running_lora_adapters="{run}",waiting_lora_adapters="{wait}"}} {t}'
            for run, wait, t in series
        ]
        return "\n".join(["# TYPE vllm:lora_requests_info gauge", *lines])

    held = AdapterSet(httpx.AsyncClient(), "http://e", LoraSlots(), lambda: None, TAGS)
    held.registered = {"a@v1": "/a", "b@v1": "/b", "c@v1": "/c"}
    assert held.in_use(text(("a@v1", "", 100.0), ("", "b@v1,x@v1", 90.0))) == ["a@v1", "b@v1"]  # x: not held
    assert held.in_use(text(("a@v1", "", 100.0), ("", "b@v1,x@v1", 90.0))) == []  # nothing new
    assert held.in_use(text(("a@v1", "", 100.0), ("c@v1", "", 101.5))) == ["c@v1"]
