"""Promotion logic with a recording deployer (the real flow is in tests/e2e/test_promotion.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from serving.config import StackConfig, parse_config
from serving.control.promotion import (
    PromotionError,
    SloPolicy,
    VersionStats,
    apply_routes,
    compare,
    parse_stats,
    promote,
    rollback,
)
from serving.control.serve_config import routing_user_config
from serving.registry import CheckpointStore, hash_tree

METRICS = """# HELP ray_raystack_requests_total x
ray_raystack_requests_total{Component="a",model="calc",status_class="2xx",tenant="t",version="v1"} 90.0
ray_raystack_requests_total{Component="b",model="calc",status_class="5xx",tenant="t",version="v1"} 10.0
ray_raystack_requests_total{model="calc",status_class="2xx",tenant="t",version="v2"} 5.0
ray_raystack_requests_total{model="other",status_class="2xx",tenant="t",version="v1"} 7.0
ray_raystack_time_to_first_token_seconds_sum{model="calc",tenant="t",version="v1"} 2.0
ray_raystack_time_to_first_token_seconds_count{model="calc",tenant="t",version="v1"} 40.0
"""


def test_parse_stats_per_version() -> None:
    s = parse_stats(METRICS, "calc")
    assert s["v1"].requests == 100 and s["v1"].errors == 10 and s["v1"].error_rate == 0.1
    assert s["v1"].ttft == pytest.approx(0.05)
    assert s["v2"].requests == 5 and s["v2"].ttft is None


def test_compare() -> None:
    p = SloPolicy()
    live = VersionStats(100, 1, 5.0, 100)
    assert compare(live, VersionStats(50, 0, 2.0, 50), p) is None
    assert "error rate" in (compare(live, VersionStats(50, 5, 2.0, 50), p) or "")
    assert "TTFT" in (compare(live, VersionStats(50, 0, 50.0, 50), p) or "")


CFG = {
    "auth": {"mode": "open"},
    "checkpoint_root": "/ck",
    "models": [{"name": "calc", "versions": [{"version": "v1"}], "gate": {"metric": "exact_match", "min": 0.9}}],
}


class Recorder:
    """A deployer that records the weights of every config it is given."""

    def __init__(self, fail_on: str | None = None, errors_for_new: int = 0) -> None:
        self.applied: list[list[tuple[str, int]]] = []
        self.fail_on, self.errors_for_new, self.calls = fail_on, errors_for_new, 0

    def apply(self, cfg: StackConfig) -> None:
        routes = routing_user_config(cfg)["models"][0]["versions"]
        self.applied.append([(v["version"], v["weight"]) for v in routes])

    def wait_running(self, apps: list[str], timeout_s: float) -> None:
        if self.fail_on and self.fail_on in apps[0]:
            raise RuntimeError(f"application {apps[0]} failed: DEPLOY_FAILED")

    def metrics_text(self) -> str:
        self.calls += 1
        n = self.calls * 20
        bad = self.errors_for_new * self.calls
        return (
            f'ray_raystack_requests_total{{model="calc",status_class="2xx",version="v1"}} {n}\n'
            f'ray_raystack_requests_total{{model="calc",status_class="2xx",version="v2"}} {n}\n'
            f'ray_raystack_requests_total{{model="calc",status_class="5xx",version="v2"}} {bad}\n'
        )


def _store(tmp: Path, score: float) -> CheckpointStore:
    d = tmp / "calc" / "v2"
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    manifest = {
        "model": "calc",
        "version": "v2",
        "eval": {"metrics": {"exact_match": score}, "n": 100},
        "files": hash_tree(d),
        "created_at": "2026-11-30T00:00:00Z",
    }
    (d / "manifest.json").write_text(json.dumps(manifest))
    return CheckpointStore(str(tmp))


def _run(tmp_path: Path, deployer: Recorder, score: float = 0.99) -> object:
    cfg = parse_config(CFG)
    return promote(
        cfg,
        "calc",
        "v2",
        store=_store(tmp_path / "ck", score),
        deployer=deployer,
        routes_file=tmp_path / "routes.json",
        base_url="http://127.0.0.1:1",
        policy=SloPolicy(step_seconds=0, warmup_requests=0, drain_seconds=0),
        sleep=lambda s: None,
        log=lambda m: None,
    )


def test_successful_promotion_steps_and_routes_file(tmp_path: Path) -> None:
    d = Recorder()
    r = _run(tmp_path, d)
    assert r.status == "promoted", r.log
    assert d.applied == [
        [("v1", 100), ("v2", 0)],
        [("v1", 90), ("v2", 10)],
        [("v1", 50), ("v2", 50)],
        [("v1", 0), ("v2", 100)],
        [("v2", 100), ("v1", 0)],
        [("v2", 100)],
    ]
    assert json.loads((tmp_path / "routes.json").read_text()) == {"calc": [{"version": "v2", "weight": 100}]}
    live = apply_routes(parse_config(CFG), tmp_path / "routes.json")
    assert live.model("calc").live_version == "v2"


def test_slo_breach_rolls_back(tmp_path: Path) -> None:
    d = Recorder(errors_for_new=10)
    r = _run(tmp_path, d)
    assert r.status == "rolled_back" and "error rate" in r.reason
    assert d.applied[-1] == [("v1", 100)]


def test_failed_deploy_rolls_back(tmp_path: Path) -> None:
    d = Recorder(fail_on="calc--v2")
    r = _run(tmp_path, d)
    assert r.status == "rolled_back" and "DEPLOY_FAILED" in r.reason
    assert d.applied == [[("v1", 100), ("v2", 0)], [("v1", 100)]]


def test_below_gate_and_tampered_are_refused_before_any_deploy(tmp_path: Path) -> None:
    d = Recorder()
    assert _run(tmp_path / "a", d, score=0.5).status == "refused" and d.applied == []
    store = _store(tmp_path / "b", 0.99)
    (tmp_path / "b" / "calc" / "v2" / "config.json").write_text('{"tampered": 1}')
    r = promote(
        parse_config(CFG),
        "calc",
        "v2",
        store=store,
        deployer=d,
        routes_file=tmp_path / "r.json",
        base_url="x",
        sleep=lambda s: None,
        log=lambda m: None,
    )
    assert r.status == "refused" and "config.json" in r.reason and d.applied == []


def test_manual_rollback_and_refusals(tmp_path: Path) -> None:
    cfg = parse_config(
        {
            **CFG,
            "models": [
                {"name": "calc", "versions": [{"version": "v1", "weight": 90}, {"version": "v2", "weight": 10}]}
            ],
        }
    )
    d = Recorder()
    assert rollback(cfg, "calc", d, tmp_path / "r.json") == "v1"
    assert d.applied == [[("v1", 100)]]
    with pytest.raises(PromotionError):
        rollback(cfg, "calc", d, tmp_path / "r.json", to="v7")
    with pytest.raises(PromotionError):
        promote(
            cfg,
            "calc",
            "v2",
            store=CheckpointStore(str(tmp_path)),
            deployer=d,
            routes_file=tmp_path / "r.json",
            base_url="x",
        )


def test_a_promotion_step_changes_only_the_gateways_user_config() -> None:
    """Serve restarts a deployment whose app args change; the gateway must only be reconfigured.
    (Found by the promotion e2e: a default ``600`` became ``600.0`` after re-validation, Serve
    rebuilt the gateway app, and with one gateway replica the port refused connections meanwhile.)"""
    from serving.config import load_config
    from serving.control.promotion import _with_versions
    from serving.control.serve_config import build_serve_config

    cfg = load_config(Path(__file__).resolve().parents[2] / "deployments" / "local.yaml")
    model = cfg.models[0]
    step = _with_versions(cfg, model.name, [(v.version, v.weight) for v in model.versions] + [("v9", 0)])
    before, after = build_serve_config(cfg), build_serve_config(step)
    strip = lambda app: json.dumps({k: v for k, v in app.items() if k != "deployments"}, sort_keys=True)  # noqa: E731
    assert strip(before["applications"][0]) == strip(after["applications"][0])  # gateway app args
    gw_before = {k: v for k, v in before["applications"][0]["deployments"][0].items() if k != "user_config"}
    gw_after = {k: v for k, v in after["applications"][0]["deployments"][0].items() if k != "user_config"}
    assert json.dumps(gw_before, sort_keys=True) == json.dumps(gw_after, sort_keys=True)
    later = {a["name"]: a for a in after["applications"]}
    for a in before["applications"][1:]:  # the versions already deployed stay exactly as they are
        assert json.dumps(a, sort_keys=True) == json.dumps(later[a["name"]], sort_keys=True)
