"""Requests the promotion controller refuses with a record, rather than serving or dropping them:
a rollback to a version that is not deployed, a promotion with settings that do not validate."""

from __future__ import annotations

from pathlib import Path

import pytest

from serving.control.controller import Controller
from serving.record import PromotionRequest
from tests.unit.test_controller import Clock, Cluster, _cfg, _controller, _publish


@pytest.fixture
def manual(tmp_path: Path) -> tuple[Controller, Cluster]:
    (tmp_path / "ck").mkdir()
    _publish(tmp_path / "ck", "calc", "v2")
    clock = Clock()
    cluster = Cluster(clock)
    ctl = _controller(tmp_path, _cfg("manual"), clock, cluster)
    ctl.control.set_live("calc", [("v1", 50), ("v2", 50)])  # a split made by hand
    ctl.tick()
    return ctl, cluster


def test_a_rollback_to_a_version_that_is_not_deployed_is_refused(manual: tuple[Controller, Cluster]) -> None:
    ctl, cluster = manual
    ctl.control.submit("calc", PromotionRequest(action="rollback", version="v9", at=0))
    ctl.tick()
    (rec,) = ctl.control.history("calc")
    assert rec.status == "refused" and rec.reason == "refused: calc@v9 is not deployed (calc serves v1, v2)"
    assert cluster.weights() == [("v1", 50), ("v2", 50)] == [(v.version, v.weight) for v in ctl.control.live()["calc"]]
    assert ctl.control.pending_request("calc") is None
    ctl.control.submit("calc", PromotionRequest(action="rollback", version="v2", at=0))
    ctl.tick()
    assert cluster.weights() == [("v2", 100)]


@pytest.mark.parametrize(
    ("overrides", "why"),
    [({"steps": [10, 50]}, "steps: Value error, steps rise strictly"), ({"step_seconds": -1}, "step_seconds: Input")],
)
def test_a_promotion_with_invalid_settings_is_refused_with_the_reason(
    manual: tuple[Controller, Cluster], overrides: dict[str, object], why: str
) -> None:
    ctl, cluster = manual
    _publish(Path(ctl.control.root), "calc", "v3")
    ctl.control.submit("calc", PromotionRequest(action="promote", version="v3", overrides=overrides, at=0))
    ctl.tick()
    (rec,) = ctl.control.history("calc")
    assert rec.status == "refused" and rec.reason.startswith(f"refused: invalid promotion settings: {why}")
    assert ctl.control.pending_request("calc") is None and cluster.weights() == [("v1", 50), ("v2", 50)]


def test_two_requests_made_before_a_poll_are_both_handled_oldest_first(manual: tuple[Controller, Cluster]) -> None:
    ctl, cluster = manual
    first = ctl.control.submit("calc", PromotionRequest(action="rollback", version="v9", at=0))
    second = ctl.control.submit("calc", PromotionRequest(action="rollback", version="v2", at=0))
    assert first < second and ctl.control.pending_request("calc", second) is not None
    ctl.tick()  # the first: refused, the second still waits
    assert [r.status for r in ctl.control.history("calc")] == ["refused"]
    assert ctl.control.pending_request("calc", first) is None
    pending = ctl.control.pending_request("calc")
    assert pending is not None and pending.version == "v2"
    ctl.tick()
    assert cluster.weights() == [("v2", 100)] and ctl.control.pending_request("calc") is None


def test_a_request_left_in_the_single_file_of_an_older_controller_is_taken_first(
    manual: tuple[Controller, Cluster], tmp_path: Path
) -> None:
    """A request written as ``requests/<model>.json`` (one per model, as older controllers read
    them) before the controller was upgraded is handled, before any made since."""
    ctl, cluster = manual
    old = PromotionRequest(action="rollback", version="v9", at=0)
    (tmp_path / "ck" / ".control" / "t" / "requests").mkdir(parents=True, exist_ok=True)
    (tmp_path / "ck" / ".control" / "t" / "requests" / "calc.json").write_text(old.model_dump_json())
    ctl.control.submit("calc", PromotionRequest(action="rollback", version="v2", at=1))
    pending = ctl.control.pending_request("calc")
    assert pending is not None and pending.version == "v9"
    ctl.tick()
    (rec,) = ctl.control.history("calc")
    assert rec.status == "refused" and "calc@v9 is not deployed" in rec.reason
    assert not (tmp_path / "ck" / ".control" / "t" / "requests" / "calc.json").exists()
    ctl.tick()
    assert cluster.weights() == [("v2", 100)] and ctl.control.pending_request("calc") is None
