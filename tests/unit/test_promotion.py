"""The watch's figures and verdicts, the Serve config of a promotion step, the store's record and
lock (decisions: tests/unit/test_controller.py; the real flow: tests/e2e/test_promotion.py)."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from serving.config import PromotionPolicy, load_config
from serving.control.controller import with_live
from serving.control.serve_config import CONTROLLER_APP, build_serve_config
from serving.control.watch import VersionStats, judge, parse_stats, percentile
from serving.lease import StoreLock
from serving.record import ControlStore, PromotionRequest

METRICS = """# HELP ray_raystack_requests_total x
ray_raystack_requests_total{Component="a",model="calc",status_class="2xx",tenant="t",version="v1"} 90.0
ray_raystack_requests_total{Component="b",model="calc",status_class="5xx",tenant="t",version="v1"} 10.0
ray_raystack_requests_total{model="calc",status_class="2xx",tenant="t",version="v2"} 5.0
ray_raystack_requests_total{model="other",status_class="2xx",tenant="t",version="v1"} 7.0
ray_raystack_time_to_first_token_seconds_bucket{model="calc",tenant="t",version="v1",le="0.1"} 30.0
ray_raystack_time_to_first_token_seconds_bucket{model="calc",tenant="t",version="v1",le="0.5"} 38.0
ray_raystack_time_to_first_token_seconds_bucket{model="calc",tenant="t",version="v1",le="+Inf"} 40.0
ray_raystack_time_to_first_token_seconds_count{model="calc",tenant="t",version="v1"} 40.0
"""
REPO = Path(__file__).resolve().parents[2]


def test_parse_stats_and_percentiles_from_the_buckets() -> None:
    s = parse_stats(METRICS, "calc")
    assert s["v1"].requests == 100 and s["v1"].errors == 10 and s["v1"].error_rate == 0.1
    assert s["v2"].requests == 5 and percentile(s["v2"], 0.5) is None
    assert percentile(s["v1"], 0.5) == pytest.approx(0.1 * 20 / 30)  # linear inside the first bucket
    assert percentile(s["v1"], 0.9) == pytest.approx(0.1 + 0.4 * (36 - 30) / 8)
    assert percentile(s["v1"], 0.99) == 0.5  # in +Inf: the last finite bound


def test_a_canary_is_judged_on_the_traffic_its_split_sent_not_on_requests_that_named_it() -> None:
    """A tenant that sends model@canary (slow prompts to fail it, many quick ones to pass it) and
    the controller's own eval and warm-up requests are counted apart (``routed="pinned"``)."""
    pinned = (
        'ray_raystack_requests_total{model="calc",routed="pinned",status_class="5xx",tenant="t",version="v2"} 50.0\n'
        'ray_raystack_requests_total{model="calc",routed="split",status_class="2xx",tenant="t",version="v2"} 4.0\n'
        'ray_raystack_time_to_first_token_seconds_bucket{model="calc",routed="pinned",tenant="t",version="v2",le="+Inf"}'
        " 50.0\n"
        'ray_raystack_time_to_first_token_seconds_count{model="calc",routed="pinned",tenant="t",version="v2"} 50.0\n'
    )
    s = parse_stats(METRICS + pinned, "calc")
    assert s["v2"].requests == 9 and s["v2"].errors == 0 and s["v2"].ttft_count == 0


def _stats(n: float, errors: float, ttft: float) -> VersionStats:
    return VersionStats(n, errors, n, {0.05: n if ttft <= 0.05 else 0, 1.0: n if ttft <= 1 else 0, float("inf"): n})


def test_judge_verdicts() -> None:
    p = PromotionPolicy(min_requests=5)
    fast, slow = _stats(50, 0, 0.04), _stats(50, 0, 0.8)
    assert judge(fast, _stats(3, 0, 0.04), fast, p).action == "extend"
    assert judge(fast, _stats(50, 5, 0.04), fast, p).action == "rollback"
    bad = judge(fast, slow, fast, p)
    assert bad.action == "rollback" and "new version is slow" in bad.reason
    held = judge(slow, slow, fast, p)  # both slow against the window before the canary
    assert held.action == "hold" and "overload" in held.reason
    assert judge(fast, fast, None, p).action == "pass"
    assert set(bad.figures) >= {"new_ttft_p50", "live_ttft_p95", "new_error_rate", "new_requests"}


def test_a_step_changes_only_the_gateways_user_config_and_never_the_controller() -> None:
    """Serve restarts a deployment whose app args change; a step must only reconfigure the gateway
    and leave the controller application exactly as it is (it is the one applying the step)."""
    seed = load_config(REPO / "deployments" / "local.yaml")
    model = seed.models[0]
    step = with_live(seed, {model.name: [(v.version, 100 - 10) for v in model.versions] + [("v9", 10)]})
    before, after = build_serve_config(seed, seed=seed), build_serve_config(step, seed=seed)
    strip = lambda app: json.dumps({k: v for k, v in app.items() if k != "deployments"}, sort_keys=True)  # noqa: E731
    assert strip(before["applications"][0]) == strip(after["applications"][0])  # gateway app args
    gw_before = {k: v for k, v in before["applications"][0]["deployments"][0].items() if k != "user_config"}
    gw_after = {k: v for k, v in after["applications"][0]["deployments"][0].items() if k != "user_config"}
    assert json.dumps(gw_before, sort_keys=True) == json.dumps(gw_after, sort_keys=True)
    later = {a["name"]: a for a in after["applications"]}
    for a in before["applications"][1:]:  # deployed versions and the controller stay as they are
        assert json.dumps(a, sort_keys=True) == json.dumps(later[a["name"]], sort_keys=True)
    assert later[CONTROLLER_APP]["args"]["config"] == seed.model_dump(mode="json")


def test_the_controllers_args_round_trip_unchanged() -> None:
    """The replica validates its args and builds every step's config with them as the seed: the
    controller app in that config must equal the one it was deployed with."""
    from serving.config import StackConfig

    seed = load_config(REPO / "deployments" / "local.yaml")
    app = {a["name"]: a for a in build_serve_config(seed, seed=seed)["applications"]}[CONTROLLER_APP]
    again = StackConfig.model_validate(app["args"]["config"])
    rebuilt = {a["name"]: a for a in build_serve_config(again, seed=again)["applications"]}[CONTROLLER_APP]
    assert json.dumps(app, sort_keys=True) == json.dumps(rebuilt, sort_keys=True)


def test_record_of_live_versions_keeps_other_models(tmp_path: Path) -> None:
    c = ControlStore(str(tmp_path), "s")
    c.set_live("a", [("v1", 90), ("v2", 10)])
    c.set_live("b", [("v3", 100)])
    c.set_live("a", [("v2", 100)])
    assert {m: [(v.version, v.weight) for v in vs] for m, vs in c.live().items()} == {
        "a": [("v2", 100)],
        "b": [("v3", 100)],
    }


@pytest.mark.parametrize("where", ["local", "s3"])
def test_requests_queue_oldest_first_and_none_is_lost(
    where: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    root = f"s3://{request.getfixturevalue('s3_bucket')}/ck" if where == "s3" else str(tmp_path)
    c = ControlStore(root, "s")
    assert c.take_request("a") is None and c.pending_request("a") is None
    keys = [c.submit("a", PromotionRequest(action="promote", version=v, at=0)) for v in ("v2", "v3")]
    c.submit("b", PromotionRequest(action="abort", at=0))
    taken = c.take_request("a")
    assert taken is not None and taken[0] == keys[0] and taken[1].version == "v2"
    assert c.pending_request("a", keys[0]) is None and c.pending_request("a", keys[1]) is not None
    c.submit("a", taken[1], taken[0])  # put back where it was (a controller that lost its lock)
    assert [r[1].version for r in (c.take_request("a"), c.take_request("a")) if r] == ["v2", "v3"]
    assert c.take_request("a") is None and c.pending_request("b") is not None


def test_lock_on_s3_is_a_conditional_write(s3_bucket: str) -> None:
    """Two clusters that read the same expired lease both try to take it: S3's If-Match lets
    exactly one write through, and the other watches; a release only expires its own lease."""
    c = ControlStore(f"s3://{s3_bucket}/ck", "s")
    t = [100.0]
    blue = StoreLock(c.lease, "blue", 30, clock=lambda: t[0], settle_s=0)
    green = StoreLock(c.lease, "green", 30, clock=lambda: t[0], settle_s=0)
    assert c.lease.conditional
    assert blue.acquire() and not green.acquire() and blue.acquire()  # renewal is a conditional write too
    t[0] += 31
    # both read the expired lease under the same ETag, then both write
    read_blue, read_green = c.lease.read_tagged(), c.lease.read_tagged()
    assert read_blue[1] == read_green[1] is not None
    won = [
        c.lease.write_if({"holder": h, "token": h, "expires_at": t[0] + 30}, etag)
        for h, (_, etag) in (("blue", read_blue), ("green", read_green))
    ]
    assert won == [True, False]
    assert c.lease.read()["holder"] == "blue"
    # creating a lease that exists fails the same way
    assert not c.lease.write_if({"holder": "x", "token": "x", "expires_at": 0}, None)
    t[0] += 31
    assert green.acquire() and not blue.held() and not blue.acquire()
    blue.release()  # not blue's: stays green's
    assert green.held()
    green.release()
    assert not green.held() and blue.acquire()


class PlainObjectStore(MemoryFileSystem):
    """Stands for an object store with no If-Match and no mutex (fsspec's own ``memory://`` gets
    the process's lock, serving.lease.LeaseFile.mutex)."""

    protocol = ("plainobj",)


fsspec.register_implementation("plainobj", PlainObjectStore, clobber=True)


def test_lock_on_an_object_store_without_conditional_writes_is_write_then_read_back() -> None:
    """The later writer wins, the earlier sees it lost."""
    c = ControlStore(f"plainobj://ck-{secrets.token_hex(4)}", "s")
    t = [100.0]
    blue = StoreLock(c.lease, "blue", 30, clock=lambda: t[0], settle_s=0)
    green = StoreLock(c.lease, "green", 30, clock=lambda: t[0], settle_s=0)
    assert not c.lease.conditional and not c.lease.is_local
    assert blue.acquire() and not green.acquire()
    t[0] += 31
    assert green.acquire() and not blue.held() and not blue.acquire()
    green.release()
    assert blue.acquire()
