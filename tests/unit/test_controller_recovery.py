"""The promotion controller when a store write, an apply or a slow hash gets in the way: the
record, ``live.json`` and what serves end up agreeing (fakes of tests/unit/test_controller.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from serving.config import StackConfig
from serving.control.controller import Controller
from serving.manifest import Manifest
from serving.record import PromotionRequest
from tests.unit.test_controller import Clock, Cluster, _cfg, _controller, _publish


@pytest.fixture
def env(tmp_path: Path) -> tuple[Path, Clock, Cluster]:
    (tmp_path / "ck").mkdir()
    clock = Clock()
    return tmp_path, clock, Cluster(clock)


def _live(ctl: Controller, model: str = "calc") -> list[tuple[str, int]]:
    return [(v.version, v.weight) for v in ctl.control.live()[model]]


def _until_rolled_back(ctl: Controller, clock: Clock, ticks: int = 20) -> None:
    for _ in range(ticks):
        ctl.tick()
        clock.t += 2
        if ctl.control.history("calc")[-1].status == "rolled_back":
            return
    raise AssertionError("no rollback")


@pytest.mark.parametrize("after", ["next poll", "another controller"])
def test_a_rollback_whose_live_json_write_failed_is_written_and_applied_after_all(env: Any, after: str) -> None:
    tmp, clock, cluster = env
    ctl = _controller(tmp, _cfg(), clock, cluster)
    _publish(tmp / "ck", "calc", "v2", score=0.95)
    cluster.score = 0.2  # the online eval rolls it back at 10%
    set_live, failed = ctl.control.set_live, []

    def flaky(model: str, versions: list[tuple[str, int]]) -> None:
        if model == "calc" and versions == [("v1", 100)] and not failed:
            failed.append(model)
            raise OSError("503 Slow Down")
        set_live(model, versions)

    ctl.tick()  # the seed recorded, then the promotion's first steps
    ctl.control.set_live = flaky  # type: ignore[method-assign]
    _until_rolled_back(ctl, clock)
    assert failed and _live(ctl) == [("v1", 90), ("v2", 10)]  # the write failed: live.json lags
    if after == "next poll":
        ctl.tick()
        applied = cluster
    else:
        ctl.lock.release()
        applied = Cluster(clock)
        ctl = _controller(tmp, _cfg(), clock, applied, holder="b")
        ctl.tick()
    assert _live(ctl) == [("v1", 100)] and applied.weights() == [("v1", 100)]
    (rec,) = ctl.control.history("calc")
    assert rec.status == "rolled_back" and not rec.live_pending


class FailingOnce(Cluster):
    """Serve refuses one apply: the first whose calc weights are ``fail_on``."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock)
        self.fail_on: list[tuple[str, int]] | None = None

    def apply(self, cfg: StackConfig) -> None:
        calc = [(v.version, v.weight) for v in cfg.model("calc").versions]
        if calc == self.fail_on:
            self.fail_on = None
            raise RuntimeError("Serve controller unavailable")
        super().apply(cfg)


def test_an_apply_that_failed_is_retried_each_poll_until_it_succeeds(env: Any) -> None:
    tmp, clock, _ = env
    cluster = FailingOnce(clock)
    ctl = _controller(tmp, _cfg(), clock, cluster)
    _publish(tmp / "ck", "calc", "v2", score=0.95)
    cluster.score = 0.2
    ctl.tick()  # the seed's apply, then the promotion's first steps
    assert len(cluster.weights()) == 2
    cluster.fail_on = [("v1", 100)]  # the rollback's apply
    _until_rolled_back(ctl, clock)
    ctl.tick()
    assert cluster.fail_on is None  # Serve refused the rollback once...
    assert cluster.weights() == [("v1", 100)] == _live(ctl)  # ...and took it at the next try


def test_the_deploy_timeout_counts_from_after_the_hashing(env: Any) -> None:
    tmp, clock, cluster = env
    ctl = _controller(tmp, _cfg("manual", deploy_timeout_s=60), clock, cluster)
    _publish(tmp / "ck", "calc", "v2")
    verify = ctl.store.verify_pinned

    def slow(*args: Any) -> tuple[Manifest, str]:
        clock.t += 300  # hashing a large checkpoint on a remote store
        return verify(*args)

    ctl.store.verify_pinned = slow  # type: ignore[method-assign]
    cluster.status["calc--v2"] = ("DEPLOYING", "")
    ctl.control.submit("calc", PromotionRequest(action="promote", version="v2", at=0))
    ctl.tick()
    clock.t += 2
    ctl.tick()
    (rec,) = ctl.control.history("calc")
    assert rec.status == "deploying" and rec.created_at == 1300.0
    clock.t += 60
    ctl.tick()
    assert ctl.control.history("calc")[0].status == "rolled_back"
