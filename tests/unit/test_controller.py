"""The promotion controller's decisions, record and lock, with a recording applier and a fake
clock (the real flow, on a running stack, is in tests/e2e/test_promotion.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from serving.config import StackConfig, parse_config
from serving.control.controller import Controller, with_live
from serving.control.serve_config import routing_user_config
from serving.lease import StoreLock
from serving.manifest import Manifest
from serving.record import ControlStore, PromotionRequest
from serving.registry import CheckpointStore, hash_tree

POLICY = {"step_seconds": 10, "warmup_requests": 0, "drain_seconds": 5, "min_requests": 5, "max_step_extensions": 2}


def _cfg(mode: str = "auto", **policy: Any) -> dict[str, Any]:
    return {
        "name": "t",
        "auth": {"mode": "open"},
        "checkpoint_root": "/ck",
        "models": [
            {
                "name": "calc",
                "versions": [{"version": "v1"}],
                "gate": {"metric": "exact_match", "min": 0.5},
                "promotion": {**POLICY, "mode": mode, **policy},
            },
            {"name": "other", "versions": [{"version": "v1"}], "promotion": {**POLICY, "mode": mode, **policy}},
        ],
    }


def _publish(root: Path, model: str, version: str, score: float = 0.9) -> None:
    d = root / model / version
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"v": version}))
    manifest = {
        "model": model,
        "version": version,
        "eval": {"metrics": {"exact_match": score}, "n": 100},
        "files": hash_tree(d),
        "created_at": "2026-11-30T00:00:00Z",
    }
    (d / "manifest.json").write_text(json.dumps(manifest))


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Cluster:
    """Applier + prober: records each applied config's weights; serves scripted metrics."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.applied: list[dict[str, list[tuple[str, int]]]] = []
        self.status: dict[str, tuple[str, str]] = {}
        self.per_tick = {"v1": (10, 0, 0.05), "v2": (10, 0, 0.05)}  # requests, errors, ttft per poll
        self.totals: dict[tuple[str, str], list[float]] = {}
        self.score: float | None = 0.9
        self.scores: dict[str, float] = {}  # per model, over ``score``
        self.warmed: list[str] = []

    def apply(self, cfg: StackConfig) -> None:
        routes = routing_user_config(cfg)["models"]
        self.applied.append({r["name"]: [(v["version"], v["weight"]) for v in r["versions"]] for r in routes})

    def weights(self, model: str = "calc") -> list[tuple[str, int]]:
        return self.applied[-1][model]

    def app_status(self, app: str) -> tuple[str, str]:
        return self.status.get(app, ("RUNNING", ""))

    def metrics_by_node(self) -> dict[str, str]:
        lines = []
        for model in ("calc", "other"):
            for v, (n, e, ttft) in self.per_tick.items():
                t = self.totals.setdefault((model, v), [0.0, 0.0, 0.0])
                t[0] += n
                t[1] += e
                t[2] = ttft
                ok, bad = t[0] - t[1], t[1]
                lab = f'model="{model}",version="{v}"'
                lines.append(f'ray_raystack_requests_total{{{lab},status_class="2xx"}} {ok}')
                lines.append(f'ray_raystack_requests_total{{{lab},status_class="5xx"}} {bad}')
                # all of this version's requests in the bucket just above its ttft
                for le in (0.05, 0.1, 0.5, 1.0, 5.0):
                    c = t[0] if ttft <= le else 0
                    lines.append(f'ray_raystack_time_to_first_token_seconds_bucket{{{lab},le="{le}"}} {c}')
                lines.append(f'ray_raystack_time_to_first_token_seconds_bucket{{{lab},le="+Inf"}} {t[0]}')
        return {"node-1": "\n".join(lines)}

    def warm(self, model: str, version: str, n: int, pooling: bool = False) -> None:
        self.warmed.append(f"{model}@{version}")

    def online_eval(self, model: str, version: str, manifest: Manifest, n: int) -> float | None:
        return self.scores.get(model, self.score)


def _controller(tmp: Path, cfg: dict[str, Any], clock: Clock, cluster: Cluster, holder: str = "a") -> Controller:
    control = ControlStore(str(tmp / "ck"), "t")
    lock = StoreLock(control.lease, holder, ttl_s=30, clock=clock)
    return Controller(parse_config(cfg), CheckpointStore(str(tmp / "ck")), control, lock, cluster, cluster, clock=clock)


def _run(ctl: Controller, clock: Clock, ticks: int, step: float = 2.0) -> None:
    for _ in range(ticks):
        ctl.tick()
        clock.t += step


@pytest.fixture
def env(tmp_path: Path) -> tuple[Path, Clock, Cluster]:
    (tmp_path / "ck").mkdir()
    clock = Clock()
    return tmp_path, clock, Cluster(clock)


def test_auto_promotes_a_newer_version_step_by_step_recording_before_applying(env: Any) -> None:
    tmp, clock, cluster = env
    ctl = _controller(tmp, _cfg(), clock, cluster)
    ctl.tick()
    assert cluster.weights() == [("v1", 100)]  # nothing newer yet: the record is applied as is
    _publish(tmp / "ck", "calc", "v2")
    for _ in range(40):
        ctl.tick()
        clock.t += 2
        # the record of what is live is always what was last applied
        live = {m: [(v.version, v.weight) for v in vs] for m, vs in ctl.control.live().items()}
        assert live["calc"] == cluster.weights()
    seen: list[list[tuple[str, int]]] = []
    for applied in cluster.applied:
        if not seen or seen[-1] != applied["calc"]:
            seen.append(applied["calc"])
    assert seen == [
        [("v1", 100)],
        [("v1", 100), ("v2", 0)],
        [("v1", 90), ("v2", 10)],
        [("v1", 50), ("v2", 50)],
        [("v1", 0), ("v2", 100)],
        [("v2", 100), ("v1", 0)],
        [("v2", 100)],
    ]
    (rec,) = ctl.control.history("calc")
    assert rec.status == "promoted" and rec.source == "auto"
    passed = [s for s in rec.steps if s.phase == "passed"]
    assert len(passed) == 3 and all(s.figures["online_score"] == 0.9 for s in passed)
    assert passed[0].figures["new_requests"] and passed[0].figures["new_ttft_p95"] is not None
    # a restart of the stack (or a re-render) reads the record: v2 serves
    assert with_live(parse_config(_cfg()), ctl.live()).model("calc").live_version == "v2"
    assert cluster.warmed == ["calc@v2"]


def test_bad_model_is_rolled_back_and_overload_is_held(env: Any) -> None:
    tmp, clock, cluster = env
    ctl = _controller(tmp, _cfg(), clock, cluster)
    _publish(tmp / "ck", "calc", "v2")
    cluster.per_tick = {"v1": (10, 0, 0.05), "v2": (10, 0, 0.9)}  # the new version alone is slow
    _run(ctl, clock, 15)
    (rec,) = ctl.control.history("calc")
    assert rec.status == "rolled_back" and "TTFT" in rec.reason and "new version is slow" in rec.reason
    assert cluster.weights() == [("v1", 100)]
    # overload: both slow against the live version's window before the canary -> held, not judged
    _publish(tmp / "ck", "calc", "v3")
    cluster.per_tick = {"v1": (10, 0, 0.05), "v3": (10, 0, 0.05)}
    cluster.status["calc--v3"] = ("DEPLOYING", "")
    _run(ctl, clock, 3)  # while v3 starts, v1 alone is fast: the baseline window
    cluster.status.clear()
    ctl.tick()
    cluster.per_tick = {"v1": (10, 0, 0.9), "v3": (10, 0, 0.9)}
    _run(ctl, clock, 20)
    rec3 = ctl.control.history("calc")[-1]
    holds = [s for s in rec3.steps if s.phase == "hold"]
    assert holds and "overload" in holds[0].note
    assert rec3.status == "rolled_back" and "after 2 extensions" in rec3.reason


def test_thin_traffic_extends_never_passes(env: Any) -> None:
    tmp, clock, cluster = env
    ctl = _controller(tmp, _cfg(), clock, cluster)
    _publish(tmp / "ck", "calc", "v2")
    cluster.per_tick = {"v1": (10, 0, 0.05), "v2": (0, 0, 0.05)}
    _run(ctl, clock, 25)
    (rec,) = ctl.control.history("calc")
    assert [s.phase for s in rec.steps].count("passed") == 0
    assert [s.phase for s in rec.steps].count("extend") == 2
    assert rec.status == "rolled_back" and "fewer than 5" in rec.reason


@pytest.mark.parametrize("traffic", [10, 0])
def test_online_eval_below_the_manifest_rolls_back_whatever_the_traffic(env: Any, traffic: int) -> None:
    tmp, clock, cluster = env
    ctl = _controller(tmp, _cfg(), clock, cluster)
    _publish(tmp / "ck", "calc", "v2", score=0.95)
    cluster.score = 0.2
    cluster.per_tick = {"v1": (10, 0, 0.05), "v2": (traffic, 0, 0.05)}
    _run(ctl, clock, 8)
    (rec,) = ctl.control.history("calc")
    assert rec.status == "rolled_back" and rec.reason.startswith("at 10%: online eval: exact_match 0.200")
    assert "vs manifest 0.950" in rec.reason and cluster.weights() == [("v1", 100)]
    assert [s.phase for s in rec.steps] == ["deploy", "step", "rollback"]


def test_refusals_are_recorded_and_not_retried(env: Any) -> None:
    tmp, clock, cluster = env
    ctl = _controller(tmp, _cfg(), clock, cluster)
    _publish(tmp / "ck", "calc", "v2", score=0.1)  # below the gate
    _publish(tmp / "ck", "other", "v2")
    (tmp / "ck" / "other" / "v2" / "config.json").write_text("{}")  # tampered
    _run(ctl, clock, 5)
    (calc,) = ctl.control.history("calc")
    (other,) = ctl.control.history("other")
    assert calc.status == "refused" and "below the gate" in calc.reason
    assert other.status == "refused" and "config.json" in other.reason
    assert all(w == {"calc": [("v1", 100)], "other": [("v1", 100)]} for w in cluster.applied)


def test_two_models_promoted_at_once_do_not_undo_each_other(env: Any) -> None:
    tmp, clock, cluster = env
    ctl = _controller(tmp, _cfg(), clock, cluster)
    _publish(tmp / "ck", "calc", "v2")
    _publish(tmp / "ck", "other", "v2")
    _run(ctl, clock, 40)
    assert cluster.applied[-1] == {"calc": [("v2", 100)], "other": [("v2", 100)]}
    for applied in cluster.applied:  # every applied config carries both models' current steps
        assert set(applied) == {"calc", "other"}
    mixed = [a for a in cluster.applied if len(a["calc"]) == 2 and len(a["other"]) == 2]
    assert mixed, "the two canaries ran side by side"


def test_two_models_at_once_one_promoted_one_rolled_back_each_ends_where_it_should(env: Any) -> None:
    """calc's v2 answers well, other's v2 badly: other's rollback leaves calc's canary where it
    is, calc's steps leave other's rollback in place, and the record says the same."""
    tmp, clock, cluster = env
    ctl = _controller(tmp, _cfg(), clock, cluster)
    _publish(tmp / "ck", "calc", "v2")
    _publish(tmp / "ck", "other", "v2")
    cluster.scores = {"other": 0.1}
    _run(ctl, clock, 40)
    assert cluster.applied[-1] == {"calc": [("v2", 100)], "other": [("v1", 100)]}
    assert [(v.version, v.weight) for v in ctl.control.live()["calc"]] == [("v2", 100)]
    assert [(v.version, v.weight) for v in ctl.control.live()["other"]] == [("v1", 100)]
    (calc,), (other,) = ctl.control.history("calc"), ctl.control.history("other")
    assert (calc.status, other.status) == ("promoted", "rolled_back") and "online eval" in other.reason
    canary = next(i for i, a in enumerate(cluster.applied) if len(a["other"]) == 2)
    rolled = next(i for i, a in enumerate(cluster.applied) if i > canary and a["other"] == [("v1", 100)])
    assert len(cluster.applied[rolled]["calc"]) == 2, "other rolled back while calc's canary was live"
    # after other's rollback, no config brought its v2 back; calc kept moving forward
    assert all(a["other"] == [("v1", 100)] for a in cluster.applied[rolled:])
    calc_v2 = [dict(a["calc"]).get("v2", 0) for a in cluster.applied]
    assert calc_v2 == sorted(calc_v2) and calc_v2[-1] == 100


def test_restart_mid_canary_resumes_from_the_record(env: Any) -> None:
    tmp, clock, cluster = env
    ctl = _controller(tmp, _cfg(), clock, cluster)
    _publish(tmp / "ck", "calc", "v2")
    _run(ctl, clock, 8)  # into the 50% step
    assert cluster.weights() == [("v1", 50), ("v2", 50)]
    ctl.lock.release()  # the replica died; its lease would expire after ttl_s
    cluster2 = Cluster(clock)
    ctl2 = _controller(tmp, _cfg(), clock, cluster2, holder="b")
    ctl2.tick()
    assert cluster2.applied[0]["calc"] == [("v1", 50), ("v2", 50)]  # applied from the record first
    _run(ctl2, clock, 30)
    (rec,) = ctl2.control.history("calc")
    assert rec.status == "promoted" and "resume" in [s.phase for s in rec.steps]
    assert cluster2.weights() == [("v2", 100)]


def test_manual_mode_waits_for_a_request_then_abort(env: Any) -> None:
    tmp, clock, cluster = env
    ctl = _controller(tmp, _cfg(mode="manual"), clock, cluster)
    _publish(tmp / "ck", "calc", "v2")
    _run(ctl, clock, 5)
    assert ctl.control.history("calc") == [] and cluster.weights() == [("v1", 100)]
    ctl.control.submit("calc", PromotionRequest(action="promote", version="v2", overrides={"steps": [50, 100]}, at=0))
    _run(ctl, clock, 4)
    assert cluster.weights() == [("v1", 50), ("v2", 50)]
    ctl.control.submit("calc", PromotionRequest(action="promote", version="v2", at=0))
    ctl.tick()  # the promotion it asks for runs already (a request put back after a failed write)
    assert [r.status for r in ctl.control.history("calc")] == ["stepping"]
    _publish(tmp / "ck", "calc", "v3")
    ctl.control.submit("calc", PromotionRequest(action="promote", version="v3", at=0))
    ctl.tick()
    assert ctl.control.history("calc")[-1].status == "refused"  # one promotion per model
    ctl.control.submit("calc", PromotionRequest(action="abort", at=0))
    ctl.tick()
    rec = ctl.control.history("calc")[0]
    assert rec.status == "aborted" and "abort" in rec.reason and cluster.weights() == [("v1", 100)]


def test_the_lock_keeps_a_second_controller_in_standby(env: Any) -> None:
    tmp, clock, cluster = env
    a = _controller(tmp, _cfg(), clock, cluster, holder="blue")
    b = _controller(tmp, _cfg(), clock, Cluster(clock), holder="green")
    assert a.tick() == "active" and b.tick() == "standby"
    clock.t += 10
    assert a.tick() == "active" and b.tick() == "standby"  # renewed
    clock.t += 31  # blue stopped renewing: its lease expired
    assert b.tick() == "active" and a.tick() == "standby"


def test_a_long_verification_keeps_the_lock_and_a_controller_that_loses_it_writes_nothing(env: Any) -> None:
    """Hashing a large version takes longer than the lock's TTL: the controller renews its lock
    meanwhile; if another one takes the lock anyway, the first records nothing and hands the
    request over."""
    tmp, clock, cluster = env
    a = _controller(tmp, _cfg("manual"), clock, cluster, holder="blue")
    a.lock.ttl_s = 0.3  # renewed every 0.1 s of real time while it verifies
    assert a.tick() == "active"
    _publish(tmp / "ck", "calc", "v2")
    renewals: list[float] = []
    acquire, verify = a.lock.acquire, a.store.verify_pinned

    def counting(renew: bool = False) -> bool:
        renewals.append(clock.t)
        return acquire(renew)

    def slow(*args: Any) -> tuple[Manifest, str]:
        time.sleep(0.45)
        return verify(*args)

    a.lock.acquire = counting  # type: ignore[method-assign]
    a.store.verify_pinned = slow  # type: ignore[method-assign]
    a.control.submit("calc", PromotionRequest(action="promote", version="v2", at=0))
    assert a.tick() == "active"
    assert len(renewals) >= 3  # the tick's own, and at least two while hashing
    assert a.control.history("calc")[0].steps[0].phase == "deploy"

    # another controller takes the lock while the first one hashes v3: no record, request kept
    _publish(tmp / "ck", "calc", "v3")
    b = _controller(tmp, _cfg("manual"), clock, Cluster(clock), holder="green")

    def taken(*args: Any) -> tuple[Manifest, str]:
        clock.t += 1  # the lock expired...
        assert b.tick() == "active"  # ...and green took it
        time.sleep(0.3)
        return verify(*args)

    a.store.verify_pinned = taken  # type: ignore[method-assign]
    a.control.submit("calc", PromotionRequest(action="abort", at=0))
    a.tick()  # the abort ends v2's promotion
    a.control.submit("calc", PromotionRequest(action="promote", version="v3", at=0))
    assert a.tick() == "standby"
    assert [r.version for r in a.control.history("calc")] == ["v2"]  # nothing about v3 written
    pending = a.control.pending_request("calc")
    assert pending is not None and pending.version == "v3"  # for green to handle


def test_a_store_that_cannot_be_read_refuses_a_manual_promotion_and_retries_an_auto_one(env: Any) -> None:
    tmp, clock, cluster = env
    ctl = _controller(tmp, _cfg("auto"), clock, cluster)
    _publish(tmp / "ck", "calc", "v2")
    verify = ctl.store.verify_pinned
    calls: list[str] = []

    def unreadable(*args: Any) -> tuple[Manifest, str]:
        calls.append(args[1])
        if len(calls) < 3:
            raise PermissionError("403 Forbidden")
        return verify(*args)

    ctl.store.verify_pinned = unreadable  # type: ignore[method-assign]
    _run(ctl, clock, 2)
    assert calls == ["v2", "v2"] and ctl.control.history("calc") == []  # not "tried": retried
    ctl.tick()
    assert ctl.control.history("calc")[0].steps[0].phase == "deploy"

    (tmp / "m" / "ck").mkdir(parents=True)
    manual = _controller(tmp / "m", _cfg("manual"), clock, Cluster(clock))
    _publish(tmp / "m" / "ck", "calc", "v2")

    def forbidden(*args: Any) -> tuple[Manifest, str]:
        raise PermissionError("403 Forbidden")

    manual.store.verify_pinned = forbidden  # type: ignore[method-assign]
    manual.control.submit("calc", PromotionRequest(action="promote", version="v2", at=0))
    manual.tick()
    (rec,) = manual.control.history("calc")
    assert rec.status == "refused" and "the store could not be read: 403 Forbidden" in rec.reason
