"""The promotion controller's online eval: its prompts are not the canary's traffic, and an eval
whose requests fail does not pass (HttpProber against a scripted gateway, httpx.MockTransport)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from serving.control.controller_app import HttpProber
from serving.manifest import Manifest
from tests.unit.test_controller import Clock, Cluster, _cfg, _controller, _publish, _run


class Probing(Cluster):
    """Each online-eval prompt is a request the metrics count, as the gateway's are."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock)
        self.evals: list[str] = []

    def online_eval(self, model: str, version: str, manifest: Manifest, n: int) -> float | None:
        self.evals.append(version)
        self.totals.setdefault((model, version), [0.0, 0.0, 0.0])[0] += n
        return super().online_eval(model, version, manifest, n)


def test_the_online_eval_prompts_do_not_count_as_canary_traffic(tmp_path: Path) -> None:
    (tmp_path / "ck").mkdir()
    clock = Clock()
    cluster = Probing(clock)
    ctl = _controller(tmp_path, _cfg(), clock, cluster)
    _publish(tmp_path / "ck", "calc", "v2")
    cluster.per_tick = {"v1": (10, 0, 0.05), "v2": (0, 0, 0.05)}  # no user sends to v2
    _run(ctl, clock, 25)
    (rec,) = ctl.control.history("calc")
    assert [s.phase for s in rec.steps] == ["deploy", "step", "extend", "extend", "rollback"]
    assert rec.status == "rolled_back" and "0 requests to the new version, fewer than 5" in rec.reason
    assert cluster.evals == ["v2"]  # the eval ran (20 prompts to v2) once, in the first window


def test_an_eval_that_raises_rolls_back_once_instead_of_running_again(tmp_path: Path) -> None:
    (tmp_path / "ck").mkdir()
    clock = Clock()
    cluster = Cluster(clock)
    calls: list[str] = []

    def unreachable(model: str, version: str, manifest: Manifest, n: int) -> float | None:
        calls.append(version)
        raise httpx.ConnectTimeout("gateway did not answer")

    cluster.online_eval = unreachable  # type: ignore[method-assign]
    ctl = _controller(tmp_path, _cfg(), clock, cluster)
    _publish(tmp_path / "ck", "calc", "v2")
    _run(ctl, clock, 15)
    (rec,) = ctl.control.history("calc")
    assert rec.status == "rolled_back" and rec.reason == "at 10%: online eval failed: gateway did not answer"
    assert calls == ["v2"] and cluster.weights() == [("v1", 100)]


def _manifest(tmp_path: Path, rows: list[dict[str, Any]] | None) -> Manifest:
    data = None
    if rows is not None:
        (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        data = {"uri": str(tmp_path / "eval.jsonl"), "sha256": "0" * 64, "rows": len(rows), "format": "completion"}
    return Manifest.model_validate(
        {"model": "calc", "version": "v2", "eval": {"metrics": {"exact_match": 0.9}, "n": 3, "data": data},
         "files": {}, "created_at": "2026-11-30T00:00:00Z"}
    )  # fmt: skip


ROWS = [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(4)]


def _gateway(answer: Any) -> HttpProber:
    def handle(request: httpx.Request) -> httpx.Response:
        return answer(json.loads(request.content))  # type: ignore[no-any-return]

    return HttpProber("http://gateway", {}, httpx.Client(transport=httpx.MockTransport(handle)))


def _right(body: dict[str, Any]) -> httpx.Response:
    return httpx.Response(200, json={"choices": [{"text": str(int(body["prompt"].split("+")[0]) + 1)}]})


def _error(body: dict[str, Any]) -> httpx.Response:
    return httpx.Response(500, json={"error": {"message": "engine dead"}})


def _timeout(body: dict[str, Any]) -> httpx.Response:
    raise httpx.ReadTimeout("no answer in 120s")


def _half(body: dict[str, Any]) -> httpx.Response:
    return _right(body) if body["prompt"] in ("0+1=", "1+1=") else _error(body)


@pytest.mark.parametrize(("answer", "score"), [(_right, 1.0), (_error, 0.0), (_timeout, 0.0), (_half, 0.5)])
def test_a_failed_eval_request_is_a_miss(tmp_path: Path, answer: Any, score: float) -> None:
    assert _gateway(answer).online_eval("calc", "v2", _manifest(tmp_path, ROWS), 10) == score


def test_no_eval_rows_is_no_score_whatever_the_gateway(tmp_path: Path) -> None:
    assert _gateway(_error).online_eval("calc", "v2", _manifest(tmp_path, None), 10) is None
    tool_calls = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": []}]}]
    assert _gateway(_error).online_eval("calc", "v2", _manifest(tmp_path, tool_calls), 10) is None


def test_a_long_reference_answer_gets_room_to_be_generated_whole(tmp_path: Path) -> None:
    """The online eval must be able to match an answer longer than a few tokens (the training
    job's eval generates the reference's length and more): a 60-byte answer gets 68 tokens."""
    long = "The sum of the two numbers you gave me is exactly forty-two."
    rows = [{"prompt": "Say it.", "completion": long}]
    asked: list[int] = []

    def answer(body: dict[str, Any]) -> httpx.Response:
        asked.append(body["max_tokens"])
        return httpx.Response(200, json={"choices": [{"text": long[: body["max_tokens"]]}]})  # 1 byte a token

    assert _gateway(answer).online_eval("calc", "v2", _manifest(tmp_path, rows), 10) == 1.0
    assert asked == [len(long) + 8]


@pytest.mark.parametrize("metric", ["mean_token_loss", "perplexity", "exact_match/plain"])
def test_an_online_eval_compared_to_a_metric_it_does_not_measure_is_refused(metric: str) -> None:
    from serving.config import OnlineEval

    with pytest.raises(ValueError, match="only the manifest's exact_match compares"):
        OnlineEval(metric=metric)


def test_a_slow_online_eval_keeps_the_lock_and_a_controller_that_loses_it_writes_nothing(tmp_path: Path) -> None:
    """Slow prompts take longer than the lock's TTL: the controller renews its lock while it
    evaluates; if another controller takes the lock anyway, the first records nothing (no step
    that would undo what the new one decided) and stands by."""
    (tmp_path / "ck").mkdir()
    clock = Clock()
    cluster = Cluster(clock)
    a = _controller(tmp_path, _cfg(), clock, cluster, holder="blue")
    a.lock.ttl_s = 0.3  # renewed every 0.1 s of real time while it evaluates
    renewals: list[float] = []
    acquire = a.lock.acquire

    def counting(renew: bool = False) -> bool:
        renewals.append(clock.t)
        return acquire(renew)

    a.lock.acquire = counting  # type: ignore[method-assign]
    slow_evals: list[str] = []

    def slow(model: str, version: str, manifest: Manifest, n: int) -> float | None:
        slow_evals.append(version)
        time.sleep(0.45)
        return 0.9

    cluster.online_eval = slow  # type: ignore[method-assign]
    _publish(tmp_path / "ck", "calc", "v2")
    _run(a, clock, 12)
    assert slow_evals and len(renewals) >= 12 + 2  # each tick's, and more while it evaluated
    (rec,) = a.control.history("calc")
    assert rec.status in ("promoted", "stepping") and "rollback" not in [s.phase for s in rec.steps]

    # a second promotion: green takes the lock while blue evaluates v3
    _run(a, clock, 20)  # v2 finishes
    _publish(tmp_path / "ck", "calc", "v3")
    b = _controller(tmp_path, _cfg(), clock, Cluster(clock), holder="green")
    called: list[str] = []
    by_green: list[dict[str, Any]] = []

    def taken(model: str, version: str, manifest: Manifest, n: int) -> float | None:
        called.append(version)
        clock.t += 1  # blue's lease expired...
        assert b.tick() == "active"  # ...and green took it (and restarted the step's window)
        by_green.append(b.control.history("calc")[-1].model_dump())
        time.sleep(0.3)
        return 0.9

    cluster.online_eval = taken  # type: ignore[method-assign]
    for _ in range(30):
        result = a.tick()
        if called:
            break
        clock.t += 1
    assert called == ["v3"] and result == "standby"
    assert a.control.history("calc")[-1].model_dump() == by_green[0]  # blue wrote nothing after losing the lock


def test_a_store_error_while_renewing_the_lock_during_a_warm_up_is_tried_again_not_a_rollback(
    tmp_path: Path,
) -> None:
    """One failed renewal (an S3 503) while the new version warms up is retried at the next
    interval: the canary goes on (it used to be rolled back as 'warm-up failed: 503')."""
    from serving.config import parse_config
    from serving.control.controller import Controller
    from serving.lease import StoreLock
    from serving.record import ControlStore
    from serving.registry import CheckpointStore

    (tmp_path / "ck").mkdir()
    clock = Clock()

    class SlowWarm(Cluster):
        def warm(self, model: str, version: str, n: int, pooling: bool = False) -> None:
            time.sleep(0.5)  # spans several renewals
            super().warm(model, version, n, pooling)

    class FlakyLock(StoreLock):
        fail_in = 0  # fail the Nth call from now (0: never)

        def acquire(self, renew: bool = False) -> bool:
            if self.fail_in:
                self.fail_in -= 1
                if self.fail_in == 0:
                    raise OSError("503 Slow Down")
            return super().acquire(renew)

    cluster = SlowWarm(clock)
    control = ControlStore(str(tmp_path / "ck"), "t")
    lock = FlakyLock(control.lease, "a", ttl_s=0.3, clock=clock)
    cfg = parse_config(_cfg(warmup_requests=1))
    ctl = Controller(cfg, CheckpointStore(str(tmp_path / "ck")), control, lock, cluster, cluster, clock=clock)
    ctl.tick()
    _publish(tmp_path / "ck", "calc", "v2")
    cluster.status["calc--v2"] = ("DEPLOYING", "")
    ctl.tick()  # the deploy step
    cluster.status.clear()
    lock.fail_in = 2  # the tick's own renewal passes, the first one during the warm-up fails
    assert ctl.tick() == "active"
    rec = control.history("calc")[-1]
    assert rec.status == "stepping" and [s.phase for s in rec.steps] == ["deploy", "step"], rec.reason
