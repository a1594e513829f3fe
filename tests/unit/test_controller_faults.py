"""The promotion controller when the store or the clock misbehaves: a write that fails, a lease that
runs out in the middle of a poll, a manifest that disappears, a last step that leaves the live
version no traffic, and a restart in the middle of an extended step (the fakes of
tests/unit/test_controller.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from serving.record import PromotionRecord, PromotionRequest
from tests.unit.test_controller import Clock, Cluster, _cfg, _controller, _publish, _run


@pytest.fixture
def env(tmp_path: Path) -> tuple[Path, Clock, Cluster]:
    (tmp_path / "ck").mkdir()
    clock = Clock()
    return tmp_path, clock, Cluster(clock)


def _latest(ctl: Any) -> PromotionRecord:
    return ctl.control.history("calc")[-1]


def _promote_with_ttft_at_100(env: Any, ttft: float) -> PromotionRecord:
    """Run ``calc@v2``'s canary; from the 100% step on, v1 gets no traffic and v2 answers in ``ttft``."""
    tmp, clock, cluster = env
    ctl = _controller(tmp, _cfg(), clock, cluster)
    _publish(tmp / "ck", "calc", "v2")
    for _ in range(60):
        ctl.tick()
        clock.t += 2
        if dict(cluster.weights()).get("v2") == 100:
            cluster.per_tick = {"v1": (0, 0, 0.05), "v2": (10, 0, ttft)}
    return _latest(ctl)


def test_an_abort_whose_record_write_fails_is_kept_and_done_at_the_next_poll(env: Any) -> None:
    tmp, clock, cluster = env
    ctl = _controller(tmp, _cfg(), clock, cluster)
    _publish(tmp / "ck", "calc", "v2")
    _run(ctl, clock, 4)
    assert _latest(ctl).status == "stepping"
    ctl.control.submit("calc", PromotionRequest(action="abort", at=0))
    save, failed = ctl.control.save, []

    def flaky(rec: PromotionRecord) -> None:
        if not failed:
            failed.append(rec.status)
            raise OSError("503 Slow Down")
        save(rec)

    ctl.control.save = flaky
    ctl.tick()
    assert failed == ["aborted"]
    assert ctl.control.pending_request("calc") is not None  # put back, not dropped
    _run(ctl, clock, 3)
    rec = _latest(ctl)
    assert rec.status == "aborted" and "abort" in rec.reason, rec.reason
    assert cluster.weights() == [("v1", 100)]
    _run(ctl, clock, 30)
    assert _latest(ctl).status == "aborted" and cluster.weights() == [("v1", 100)]


def test_a_controller_whose_lease_ran_out_during_a_poll_writes_nothing(env: Any) -> None:
    """Blue's metric reads take longer than the lease (unreachable nodes); green takes the lease
    meanwhile and resumes the step. Blue then neither records its verdict nor applies a split."""
    tmp, clock, cluster = env
    blue = _controller(tmp, _cfg(), clock, cluster, holder="blue")
    green_cluster = Cluster(clock)
    green = _controller(tmp, _cfg(), clock, green_cluster, holder="green")
    _publish(tmp / "ck", "calc", "v2")
    for _ in range(3):
        assert blue.tick() == "active" and green.tick() == "standby"
        clock.t += 2
    rec = _latest(blue)
    assert rec.status == "stepping" and rec.step_index == 0
    clock.t += 10  # the step is due
    read, seen = cluster.metrics_by_node, []

    def slow() -> dict[str, str]:
        out = read()
        if not seen:
            clock.t += 31  # three unreachable nodes at a 10 s timeout each
            seen.append(green.tick())
        return out

    cluster.metrics_by_node = slow  # type: ignore[method-assign]
    applied = len(cluster.applied)
    assert blue.tick() == "standby"
    assert seen == ["active"]
    rec = _latest(green)
    assert [s.phase for s in rec.steps][-1] == "resume" and rec.step_index == 0  # green's, not overwritten
    assert len(cluster.applied) == applied  # blue applied nothing
    assert blue.control.lease.read()["holder"] == "green"


def test_a_canary_whose_manifest_disappears_is_rolled_back(env: Any) -> None:
    tmp, clock, cluster = env
    ctl = _controller(tmp, _cfg(), clock, cluster)
    _publish(tmp / "ck", "calc", "v2")
    _run(ctl, clock, 3)
    assert cluster.weights() == [("v1", 90), ("v2", 10)]
    (tmp / "ck" / "calc" / "v2" / "manifest.json").unlink()
    _run(ctl, clock, 20)
    rec = _latest(ctl)
    assert rec.status == "rolled_back" and "manifest.json of calc@v2 cannot be read" in rec.reason, rec.reason
    assert cluster.weights() == [("v1", 100)]


def test_a_new_version_slow_only_at_100_percent_is_held_to_the_live_versions_baseline(env: Any) -> None:
    """At the last step the split gives the live version nothing, so there is no live TTFT in the
    window: the new one is compared with the live version's window before the canary."""
    rec = _promote_with_ttft_at_100(env, 4.0)
    cluster = env[2]
    assert rec.status == "rolled_back", [(s.phase, s.note) for s in rec.steps]
    assert "TTFT p50" in rec.reason and "vs live before the canary" in rec.reason, rec.reason
    assert cluster.weights() == [("v1", 100)]


def test_a_clean_100_percent_step_still_passes(env: Any) -> None:
    rec = _promote_with_ttft_at_100(env, 0.05)
    assert rec.status == "promoted" and env[2].weights() == [("v2", 100)]


def test_a_restart_keeps_the_steps_extensions(env: Any) -> None:
    tmp, clock, cluster = env
    ctl = _controller(tmp, _cfg(), clock, cluster)
    _publish(tmp / "ck", "calc", "v2")
    _run(ctl, clock, 3)
    cluster.per_tick = {"v1": (10, 0, 0.05), "v2": (1, 0, 0.05)}  # too few requests: extended
    _run(ctl, clock, 6)
    assert _latest(ctl).extensions == 1
    clock.t += 31  # the first controller died; its lease ran out
    again = _controller(tmp, _cfg(), clock, Cluster(clock))
    again.tick()
    rec = _latest(again)
    assert rec.steps[-1].phase == "resume" and rec.extensions == 1


def test_a_lease_taken_by_another_holder_is_never_renewed_by_the_first(tmp_path: Path) -> None:
    """``ensure`` renews only a lease that still carries this holder's token: once another holder
    took it, even after that one's lease ran out, the first may have missed what it did."""
    from serving.lease import LockLost, StoreLock
    from serving.record import ControlStore

    clock = Clock()
    lease = ControlStore(str(tmp_path), "t").lease
    blue, green = StoreLock(lease, "blue", 30, clock=clock), StoreLock(lease, "green", 30, clock=clock)
    assert blue.acquire()
    reads = []
    read = lease.read
    lease.read = lambda: reads.append(1) or read()  # type: ignore[method-assign]
    blue.ensure("a write")  # renewed a moment ago: no store call
    assert reads == []
    clock.t += 11  # a third of the lease: renewed before the write
    blue.ensure("a write")
    assert reads and lease.read()["expires_at"] == clock.t + 30
    clock.t += 31
    assert green.acquire()
    clock.t += 31  # green's lease ran out too
    with pytest.raises(LockLost, match="lost the lock before a write"):
        blue.ensure("a write")
    assert blue.acquire()  # a new poll may take it again, and starts from the store's record
