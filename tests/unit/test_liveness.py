"""The replica's hang detection: work without progress for stall_s, judged on good scrapes only;
and the warm-up that keeps a new engine's first logprobs request from looking like a hang."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx

from serving.replica.liveness import StallWatch, warm_up


def _m(running: float = 0, waiting: float = 0, gen: float = 0, prompt: float = 0) -> dict[str, float]:
    return {
        "vllm:num_requests_running": running,
        "vllm:num_requests_waiting": waiting,
        "vllm:generation_tokens_total": gen,
        "vllm:prompt_tokens_total": prompt,
    }


def _scrapes(
    watch: StallWatch,
    values: dict[str, float] | Callable[[float], dict[str, float]],
    start: float,
    end: float,
    step: float = 1.0,
) -> list[float]:
    """Scrape every ``step`` s; returns the times at which the engine was found hung."""
    hung, now = [], start
    while now <= end:
        if watch.observe(values(now) if callable(values) else values, now):
            hung.append(now)
        now += step
    return hung


def test_work_without_progress_is_a_hang() -> None:
    watch = StallWatch(stall_s=10)
    assert _scrapes(watch, _m(running=3, gen=500, prompt=90), 0, 9) == []
    assert watch.observe(_m(running=3, gen=500, prompt=90), 10) is True


def test_generated_or_prefilled_tokens_are_progress() -> None:
    watch = StallWatch(stall_s=10)
    assert _scrapes(watch, lambda now: _m(running=2, gen=int(now) // 3), 0, 60) == []
    # a long prefill: no token generated, but prompt tokens processed
    assert _scrapes(watch, lambda now: _m(running=1, waiting=4, gen=20, prompt=int(now) // 5), 61, 120) == []


def test_an_idle_engine_is_not_hung() -> None:
    watch = StallWatch(stall_s=10)
    assert _scrapes(watch, _m(gen=500, prompt=90), 0, 60) == []
    # work arrives: the period starts then, not at the last token
    assert _scrapes(watch, _m(waiting=1, gen=500, prompt=90), 61, 70) == []
    assert watch.observe(_m(waiting=1, gen=500, prompt=90), 71) is True


def test_failed_or_late_scrapes_start_the_period_again() -> None:
    """The API server was slow or stopped: its counters lag, so they prove nothing."""
    watch = StallWatch(stall_s=10, max_gap_s=3)
    stuck = _m(running=3, gen=500)
    assert _scrapes(watch, stuck, 0, 6) == []
    watch.reset()  # a scrape failed
    assert _scrapes(watch, stuck, 7, 16) == []
    assert _scrapes(watch, stuck, 30, 39) == []  # 14 s without a scrape
    assert watch.observe(stuck, 40) is True


def test_an_engine_that_looks_idle_and_still_is_gets_a_probe() -> None:
    """Frozen gauges that say "no work" prove nothing: after stall_s / 2 without any counter
    moving, the replica asks the engine for a token."""
    watch = StallWatch(stall_s=10)
    assert _scrapes(watch, lambda now: _m(running=1, gen=int(now)), 0, 10) == []
    assert not watch.should_probe(10)  # it was busy
    assert _scrapes(watch, _m(gen=10), 11, 14) == []  # the last token came at 10
    assert not watch.should_probe(14)
    watch.observe(_m(gen=10), 15)
    assert watch.should_probe(15)  # idle and unmoved for 5 s
    watch.observe(_m(gen=11), 17)  # the probe's token
    assert not watch.should_probe(17)
    watch.observe(_m(running=2, gen=11), 30)  # busy again: the stall rule judges it
    assert not watch.should_probe(30)


def test_warm_up_asks_the_new_engine_for_logprobs_with_its_token() -> None:
    """The replica's warm-up is one token with logprobs (the request that makes vLLM compile its
    logprob-rank kernel), to the served model, with the engine's token; an engine that refuses it
    (e.g. ``max_logprobs: 0``) or cannot be reached is logged, not fatal."""
    seen: list[httpx.Request] = []

    def engine(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"choices": [{"text": "1"}]})

    with httpx.Client(transport=httpx.MockTransport(engine)) as c:
        warm_up("http://engine:1", "tok", "adder", 30, client=c)
    assert len(seen) == 1 and seen[0].url == "http://engine:1/v1/completions"
    assert seen[0].headers["authorization"] == "Bearer tok"
    body = json.loads(seen[0].content)
    assert body["model"] == "adder" and body["logprobs"] >= 1 and body["max_tokens"] == 1

    def refuses(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "logprobs > max_logprobs"}})

    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    for handler in (refuses, down):
        with httpx.Client(transport=httpx.MockTransport(handler)) as c:
            warm_up("http://engine:1", "tok", "adder", 30, client=c)  # no exception
