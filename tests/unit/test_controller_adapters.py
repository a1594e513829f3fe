"""The promotion controller with LoRA adapters on the base it promotes: every step it records can
be deployed (built as a deploy builds it, manifests read), so a base version an adapter runs on is
never dropped, and a step that cannot be built is refused instead of recorded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from serving.config import StackConfig
from serving.control.controller import Controller
from serving.control.serve_config import build_serve_config
from serving.record import PromotionRequest
from tests.unit.test_adapter_bases import store_down
from tests.unit.test_adapters import _calc_and_sub, _Cluster, _publish_adapter, _stack
from tests.unit.test_controller import POLICY, Clock, _controller, _publish, _run


class Serve(_Cluster):
    """Builds each config as ServeApplier does before it records the weights: a config that cannot
    be deployed raises, as ``deploy_apps`` would never get it."""

    def apply(self, cfg: StackConfig) -> None:
        build_serve_config(cfg, None, read_manifests=True)
        super().apply(cfg)


def _live(ctl: Controller, model: str) -> list[tuple[str, int]]:
    return [(v.version, v.weight) for v in ctl.control.live()[model]]


@pytest.fixture
def based(tmp_path: Path) -> tuple[Controller, Clock, Serve, Path]:
    """calc v2 live, v1 at 0 % for sub@v1 (trained on calc@v1)."""
    root = tmp_path / "ck"
    root.mkdir()
    clock = Clock()
    cluster = Serve(clock)
    for version in ("v1", "v2"):
        _publish(root, "calc", version)
    _publish_adapter(root, "sub", "v1", "calc@v1")
    cfg = _stack(root, [{"name": "sub", "base": "calc", "versions": [{"version": "v1"}]}])
    cfg["models"][0] |= {
        "versions": [{"version": "v2", "weight": 100}, {"version": "v1", "weight": 0}],
        "promotion": {**POLICY, "mode": "manual"},
    }
    return _controller(tmp_path, cfg, clock, cluster), clock, cluster, root


@pytest.mark.parametrize("score", [0.9, 0.2])
def test_promoting_or_rolling_back_a_base_keeps_the_version_an_adapter_runs_on(based: Any, score: float) -> None:
    ctl, clock, cluster, root = based
    _publish(root, "calc", "v3")
    cluster.score = score
    cluster.per_tick = {"v2": (10, 0, 0.05), "v3": (10, 0, 0.05)}
    ctl.control.submit("calc", PromotionRequest(action="promote", version="v3", at=0))
    _run(ctl, clock, 40)
    (rec,) = ctl.control.history("calc")
    assert all(dict(a["calc"]).get("v1") == 0 for a in cluster.applied)  # every apply kept sub's base
    assert all(s.weights.get("v1") == 0 for s in rec.steps if s.weights)
    if score == 0.9:
        assert rec.status == "promoted" and "v1 kept at 0%" in rec.steps[-1].note
        assert _live(ctl, "calc") == cluster.weights("calc") == [("v3", 100), ("v1", 0)]  # v2 removed
    else:
        assert rec.status == "rolled_back"
        assert _live(ctl, "calc") == cluster.weights("calc") == [("v2", 100), ("v1", 0)]  # as before
    assert [(s.phase, s.weights) for s in rec.steps][:2] == [
        ("deploy", {"v2": 100, "v1": 0, "v3": 0}),
        ("step", {"v2": 90, "v1": 0, "v3": 10}),
    ]


def test_a_promotion_whose_config_cannot_be_built_is_refused_not_recorded(based: Any) -> None:
    ctl, clock, cluster, root = based
    ctl.tick()
    applied = len(cluster.applied)
    _publish_adapter(root, "sub", "v2", "calc@v2", rank=64)  # above calc's max_lora_rank (16)
    ctl.control.submit("sub", PromotionRequest(action="promote", version="v2", at=0))
    _run(ctl, clock, 3)
    (rec,) = ctl.control.history("sub")
    assert rec.status == "refused" and "rank 64 exceeds" in rec.reason
    assert [s.weights for s in rec.steps if s.weights] == [] and _live(ctl, "sub") == [("v1", 100)]
    assert len(cluster.applied) == applied  # nothing new was applied...
    assert cluster.weights("sub") == [("v1", 100)]  # ...and what serves is what was recorded


def test_an_adapter_version_not_trained_yet_does_not_stop_the_bases_promotion(tmp_path: Path) -> None:
    """A configured adapter version at weight 0 with no checkpoint yet (on Kubernetes nothing
    builds it before it is published): its base version is not known, and the base's promotion
    goes on (every tick used to raise)."""
    root, clock, cluster = _calc_and_sub(tmp_path)
    versions = [{"version": "v1", "weight": 100}, {"version": "v2", "weight": 0}]  # sub@v2: not published
    cfg = _stack(root, [{"name": "sub", "base": "calc", "versions": versions}])
    cfg["models"][0] |= {"promotion": {**POLICY, "mode": "manual"}}
    ctl = _controller(tmp_path, cfg, clock, cluster)
    _publish(root, "calc", "v2")
    ctl.control.submit("calc", PromotionRequest(action="promote", version="v2", at=0))
    for _ in range(4):
        assert ctl.tick() == "active"
        clock.t += 2
    (rec,) = ctl.control.history("calc")
    assert rec.steps[0].phase == "deploy" and rec.status != "refused", rec
    assert ("v2", 0) in _live(ctl, "calc") or ("v2", 10) in _live(ctl, "calc")


@pytest.mark.parametrize("looks_empty", [False, True])
def test_a_store_outage_removes_no_base_version_and_the_apply_waits_for_the_store(
    based: Any, looks_empty: bool
) -> None:
    """A restarted controller that cannot read sub@v1's manifest (a store out of reach; on a local
    disk the folders may even look absent) keeps calc@v1, which sub@v1 runs on: it removes nothing
    of calc that poll, and its apply, which reads the manifests, fails and leaves what served; the
    next poll with the store back applies it (removing calc@v1 used to break every apply for good)."""
    ctl, clock, cluster, root = based
    _run(ctl, clock, 2)
    served = cluster.applied[-1]
    assert _live(ctl, "calc") == [("v2", 100), ("v1", 0)] == served["calc"]
    clock.t += 60  # the old controller's lease expired: a new one (nothing cached) takes over
    ctl2 = _controller(root.parent, ctl.seed.model_dump(mode="json"), clock, cluster, holder="b")
    with store_down(looks_empty):
        needed = ctl2.bases.needed(ctl2.current())
        assert needed.versions == {} and "sub@v1's manifest cannot be read" in needed.unknown["calc"]
        assert ctl2.tick() == "active"
        clock.t += 2
        assert ctl2.tick() == "active"  # retried: still failing
        clock.t += 2
    assert _live(ctl2, "calc") == [("v2", 100), ("v1", 0)]
    assert cluster.applied[-1] is served and ctl2._dirty  # the old config serves; an apply is due
    ctl2.tick()
    assert not ctl2._dirty and cluster.applied[-1] is not served
    assert cluster.weights("calc") == [("v2", 100), ("v1", 0)] == _live(ctl2, "calc")


def test_a_step_while_a_manifest_cannot_be_read_keeps_every_served_base_version(based: Any) -> None:
    """Any base version may be the one an unreadable adapter version runs on: a step (here the end
    of calc v3's promotion) keeps each at 0 %; with the store back, only the one sub@v1 needs."""
    ctl, _, _, root = based
    _publish(root, "calc", "v3")
    with store_down():
        assert ctl.bases.keep_needed(ctl.current(), "calc", {"v3": 100}) == {"v3": 100, "v2": 0, "v1": 0}
    assert ctl.bases.keep_needed(ctl.current(), "calc", {"v3": 100}) == {"v3": 100, "v1": 0}
