"""Manifest pins: a version's replicas hold the store's manifest to the sha256 its promotion's gate
checked (or the stack config's ``manifest_sha256``), so a version rewritten in the store after the
check, files and manifest together, is not served. The pin travels from the controller's record
(``live.json``) through every config built from it: ``serving up``, the controller's applies and
``serving render-k8s`` (whose header carries it, so a check without the store renders it too)."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from serving.config import ConfigError, LoraSlots, StackConfig, load_config, parse_config
from serving.control.controller import with_live
from serving.control.k8s import LIVE_HEADER, committed_live, for_k8s, stale_k8s, store_live, write_k8s
from serving.control.serve_config import build_serve_config
from serving.record import ControlStore
from serving.replica.adapters import AdapterRefused, AdapterSet
from tests.unit.test_adapters import TAGS, _Engine, _publish_adapter
from tests.unit.test_controller import Clock, Cluster, _cfg, _controller, _publish
from tests.unit.test_k8s_live import _repo, _serve_config


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _specs(cfg: StackConfig) -> dict[str, dict[str, Any]]:
    """Each model application's EngineSpec args, by app name."""
    apps = build_serve_config(cfg, base=None, seed=cfg)["applications"]
    return {a["name"]: a["args"]["spec"] for a in apps if "spec" in a.get("args", {})}


class Configs(Cluster):
    """The recording cluster, keeping every applied stack config too."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock)
        self.configs: list[StackConfig] = []

    def apply(self, cfg: StackConfig) -> None:
        super().apply(cfg)
        self.configs.append(cfg)


def test_a_promotion_pins_the_manifest_its_gate_checked(tmp_path: Path) -> None:
    (tmp_path / "ck").mkdir()
    clock = Clock()
    cluster = Configs(clock)
    ctl = _controller(tmp_path, _cfg(), clock, cluster)
    ctl.tick()
    _publish(tmp_path / "ck", "calc", "v2")
    pin = _sha(tmp_path / "ck" / "calc" / "v2" / "manifest.json")
    ctl.tick()
    (rec,) = ctl.control.history("calc")
    assert rec.manifest_sha256 == pin
    deployed = _specs(cluster.configs[-1])
    assert deployed["calc--v2"]["manifest_sha256"] == pin  # the canary's replicas are held to it
    assert "manifest_sha256" not in deployed["calc--v1"]  # the seed pins nothing: its args are unchanged

    for _ in range(40):
        clock.t += 2
        ctl.tick()
    (rec,) = ctl.control.history("calc")
    assert rec.status == "promoted"
    assert [v.model_dump(exclude_none=True) for v in ctl.control.live()["calc"]] == [
        {"version": "v2", "weight": 100, "manifest_sha256": pin}
    ]
    assert all(_specs(c)["calc--v2"]["manifest_sha256"] == pin for c in cluster.configs if "calc--v2" in _specs(c))
    # a restart of the stack (serving up applies the record) keeps it
    assert _specs(with_live(parse_config(_cfg()), ctl.live()))["calc--v2"]["manifest_sha256"] == pin


def test_a_manifest_rewritten_during_the_canary_rolls_it_back_at_its_eval(tmp_path: Path) -> None:
    """The online eval compares with the manifest's claimed score: one rewritten in the store
    after the gate (here a claim lowered so that any answer passes) is not believed."""
    (tmp_path / "ck").mkdir()
    clock = Clock()
    cluster = Configs(clock)
    ctl = _controller(tmp_path, _cfg(), clock, cluster)
    _publish(tmp_path / "ck", "calc", "v2")
    pin = _sha(tmp_path / "ck" / "calc" / "v2" / "manifest.json")
    ctl.tick()
    manifest = tmp_path / "ck" / "calc" / "v2" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"exact_match": 0.9', '"exact_match": 0.1'))
    for _ in range(20):
        clock.t += 2
        ctl.tick()
    (rec,) = ctl.control.history("calc")
    assert rec.status == "rolled_back" and rec.manifest_sha256 == pin
    assert "manifest.json of calc@v2 changed in the store since its gate checked it" in rec.reason
    assert cluster.weights() == [("v1", 100)]


def test_a_pin_is_kept_through_later_weights_and_the_record_wins_over_the_yaml(tmp_path: Path) -> None:
    control = ControlStore(str(tmp_path), "t")
    control.set_live("calc", [("v1", 90), ("v2", 10, "b" * 64)])
    control.set_live("calc", [("v1", 50), ("v2", 50)])  # a step gives weights only
    assert [v.entry() for v in control.live()["calc"]] == [("v1", 50), ("v2", 50, "b" * 64)]
    raw = json.loads((tmp_path / ".control" / "t" / "live.json").read_text())
    assert raw["models"]["calc"][0] == {"version": "v1", "weight": 50}  # no pin: no key

    seed = _cfg()
    seed["models"][0]["versions"] = [{"version": "v1", "manifest_sha256": "a" * 64}]
    cfg = with_live(parse_config(seed), {"calc": [v.entry() for v in control.live()["calc"]]})
    assert [(v.version, v.manifest_sha256) for v in cfg.model("calc").versions] == [("v1", "a" * 64), ("v2", "b" * 64)]
    with pytest.raises(ConfigError, match="manifest_sha256 must be 64 lowercase hex digits"):
        seed["models"][0]["versions"] = [{"version": "v1", "manifest_sha256": "ABC"}]
        parse_config(seed)


def test_render_k8s_carries_the_records_pins_and_checks_them_without_the_store(tmp_path: Path) -> None:
    repo, patch = _repo(tmp_path / "repo", tmp_path / "store")
    pin = "c" * 64
    ControlStore(str(tmp_path / "store"), "gpu-prod").set_live("llama-8b", [("v1", 0), ("v2", 100, pin)])
    write_k8s(repo, live=store_live)
    assert LIVE_HEADER + f'{{"llama-8b":[["v1",0],["v2",100,"{pin}"]]}}' in patch.read_text()
    seed = for_k8s(load_config(repo / "deployments" / "gpu-prod.yaml"))
    assert committed_live(seed, patch) == {"llama-8b": [("v1", 0), ("v2", 100, pin)]}
    apps = {a["name"]: a for a in _serve_config(patch)["applications"]}  # type: ignore[attr-defined]
    assert apps["llama-8b--v2"]["args"]["spec"]["manifest_sha256"] == pin
    assert stale_k8s(repo) == []  # re-rendered from the header alone, pin included


def test_an_adapter_version_is_held_to_its_pin(tmp_path: Path) -> None:
    d = _publish_adapter(tmp_path, "sub", "v1", "calc@v1")
    pin = _sha(d / "manifest.json")
    stack = {
        "name": "t",
        "auth": {"mode": "open"},
        "checkpoint_root": str(tmp_path),
        "models": [
            {"name": "calc", "versions": [{"version": "v1"}], "lora": {"max_loras": 1}},
            {"name": "sub", "base": "calc", "versions": [{"version": "v1", "manifest_sha256": pin}]},
        ],
    }
    apps = {a["name"]: a for a in build_serve_config(parse_config(stack), read_manifests=True)["applications"]}
    (dep,) = apps["calc--v1"]["deployments"]
    assert dep["user_config"] == {"adapters": {"sub@v1": str(d)}, "pins": {"sub@v1": pin}}
    engine = _Engine()

    async def scenario() -> None:
        client = httpx.AsyncClient(transport=httpx.MockTransport(engine))
        held = AdapterSet(client, "http://e", LoraSlots(), lambda: None, TAGS, cache_dir=str(tmp_path / "cache"))
        held.configure({"sub@v1": str(d)}, {"sub@v1": "d" * 64})
        with pytest.raises(AdapterRefused, match="sub@v1: .*manifest.json has sha256"):
            await held.load("sub@v1")
        held.configure({"sub@v1": str(d)}, {"sub@v1": pin})  # the pin it was promoted with: not the refusal kept
        await held.load("sub@v1")

    asyncio.run(scenario())
    assert [c[0] for c in engine.calls] == ["/v1/load_lora_adapter"]
