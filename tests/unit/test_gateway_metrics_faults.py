"""The gateway's request metrics, driven through the real app (``create_api(GatewayCore)``) with
stand-in replicas on loopback: an engine's error event inside a stream counts by its status, not
as a success with a TTFT; requests refused before they are forwarded are counted once, in
``raystack_refused_requests``; the in-flight gauge is set when a request starts; TTFT and latency
start at the request's arrival; inter-token latency is per choice."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from aiohttp import web

from loadtests.relay import OneReplica
from serving.config import GatewayConfig, parse_config
from serving.control.serve_config import routing_user_config
from serving.control.watch import parse_stats
from serving.errors import RateLimited
from serving.gateway.admission.auth import hash_key
from serving.gateway.agent_protocol import EventTap, parse_agent_request
from serving.gateway.answers import StreamTap, error_status
from serving.gateway.api import create_api
from serving.gateway.core import Exchange, GatewayCore
from serving.gateway.protocol import parse_request
from serving.metrics import GatewayMetrics
from tests.support.loopback import http_replica

KEY = "sk-metrics-faults-0123456789"
AUTH = {"authorization": f"Bearer {KEY}"}


def _stack(auth: dict[str, Any] | None = None, **model: Any) -> dict[str, Any]:
    m = {"name": "m", "engine": {"max_model_len": 256}, "versions": [{"version": "v1"}], **model}
    return {"auth": auth or {"mode": "open"}, "models": [m]}


class Recorder:
    """Ray's metrics need a cluster: every metric call, through the real ``tags``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, float, dict[str, str]]] = []

    def tags(self, *args: Any) -> dict[str, str]:
        return GatewayMetrics.tags(None, *args)  # type: ignore[arg-type]

    def of(self, name: str) -> list[tuple[float, dict[str, str]]]:
        return [(v, t) for n, _, v, t in self.calls if n == name]

    def __getattr__(self, name: str) -> Any:
        calls = self.calls

        class Metric:
            def inc(self, value: float = 1, tags: dict[str, str] | None = None) -> None:
                calls.append((name, "inc", value, tags or {}))

            def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
                calls.append((name, "observe", value, tags or {}))

            def set(self, value: float, tags: dict[str, str] | None = None) -> None:
                calls.append((name, "set", value, tags or {}))

        return Metric()


def ev(obj: Any) -> bytes:
    """An event as vLLM streams a chunk (pydantic's compact JSON)."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


@asynccontextmanager
async def gateway(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    settings: GatewayConfig | None = None,
    stack: dict[str, Any] | None = None,
) -> AsyncIterator[tuple[httpx.AsyncClient, GatewayCore, Recorder]]:
    async with http_replica(handler) as url:
        core = GatewayCore(settings or GatewayConfig(max_migrations=0), OneReplica(url))
        core.reconfigure(routing_user_config(parse_config(stack or _stack())))
        core.metrics = rec = Recorder()
        transport = httpx.ASGITransport(app=create_api(core))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=10) as c:
                yield c, core, rec
        finally:
            await core.aclose()


FIRST = {
    "id": "c",
    "object": "text_completion",
    "created": 1,
    "model": "m",
    "choices": [{"index": 0, "text": " a", "token_ids": [5], "prompt_token_ids": [1, 2], "finish_reason": None}],
}
# vLLM 0.32's mid-stream error: json.dumps of its ErrorResponse (serving_completion, serving_chat)
ENGINE_ERROR = ev(
    {"error": {"message": "internal engine error", "type": "InternalServerError", "param": None, "code": 500}}
)


def _erring(error: bytes) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(ev(FIRST))
        await resp.write(error)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    return handler


# --- 1. an engine's error event inside a stream --------------------------------------------------


@pytest.mark.parametrize("migrations", [0, 1])
async def test_an_engine_error_event_in_a_stream_counts_as_5xx_with_no_ttft(migrations: int) -> None:
    """The engine (healthy: it answers /health) ends the stream with its 500: the client gets that
    event once, unchanged, and the request counts as a 5xx with no TTFT or ITL, whether the
    stream passes through the exchange alone or through the splice (which holds a 5xx back)."""
    body = {"model": "m", "prompt": "hi", "max_tokens": 4, "stream": True}
    async with gateway(_erring(ENGINE_ERROR), GatewayConfig(max_migrations=migrations)) as (c, _, rec):
        r = await c.post("/v1/completions", json=body)
    assert r.status_code == 200
    assert r.content.count(b"internal engine error") == 1 and ENGINE_ERROR in r.content
    assert [t["status_class"] for _, t in rec.of("requests")] == ["5xx"]
    assert [t["status_class"] for _, t in rec.of("api_requests")] == ["5xx"]
    assert rec.of("ttft") == [] and rec.of("itl") == []
    assert len(rec.of("e2e")) == 1


async def test_an_engine_client_error_event_counts_as_4xx() -> None:
    error = ev({"error": {"message": "bad grammar", "type": "BadRequestError", "param": None, "code": 400}})
    body = {"model": "m", "prompt": "hi", "max_tokens": 4, "stream": True}
    async with gateway(_erring(error)) as (c, _, rec):
        r = await c.post("/v1/completions", json=body)
    assert r.status_code == 200 and error in r.content
    assert [t["status_class"] for _, t in rec.of("requests")] == ["4xx"] and rec.of("ttft") == []


async def test_the_canary_judge_counts_streamed_engine_errors() -> None:
    """serving.control.watch reads raystack_requests by status class: the stream's error is one."""
    body = {"model": "m", "prompt": "hi", "max_tokens": 4, "stream": True}
    async with gateway(_erring(ENGINE_ERROR)) as (c, _, rec):
        await c.post("/v1/completions", json=body)
    lines = [
        "ray_raystack_requests_total{" + ",".join(f'{k}="{v}"' for k, v in tags.items()) + f"}} {value}"
        for value, tags in rec.of("requests")
    ]
    stats = parse_stats("\n".join(lines), "m")["v1"]
    assert stats.requests == 1 and stats.errors == 1 and stats.ttft_count == 0


def test_error_status_reads_the_code_or_the_type() -> None:
    assert error_status(ENGINE_ERROR) == 500
    assert error_status(ev({"error": {"message": "x", "type": "BadRequestError", "code": 400}})) == 400
    anthropic = b'event: error\ndata: {"type":"error","error":{"type":"internal_error","message":"boom"}}'
    assert error_status(anthropic) == 500
    overloaded = b'event: error\ndata: {"type":"error","error":{"type":"invalid_request_error","message":"x"}}'
    assert error_status(overloaded) == 400
    responses = b'event: error\ndata: {"type":"error","code":"rate_limit_exceeded","message":"x","param":null}'
    assert error_status(responses) == 400
    assert error_status(b'event: error\ndata: {"type":"error","code":"server_error","message":"x"}') == 500
    assert error_status(b"data: {not json") == 500


def test_the_taps_note_the_first_error_and_pass_it_on_unchanged() -> None:
    tap = StreamTap(strip_usage=True)
    text = ev({**FIRST, "choices": [{"index": 0, "text": 'data: {"error": 1}'}]})  # a token's text says it
    assert tap.feed(text) == text and tap.error is None
    second = ev({"error": {"message": "bad", "type": "BadRequestError", "code": 400}})
    assert tap.feed(ENGINE_ERROR[:20]) == b"" and tap.feed(ENGINE_ERROR[20:] + second) == ENGINE_ERROR + second
    assert tap.error == 500  # the first

    events = EventTap("messages")
    start = b'event: message_start\ndata: {"type":"message_start","message":{"usage":{"input_tokens":3}}}\n\n'
    error = b'event: error\ndata: {"type":"error","error":{"type":"internal_error","message":"boom"}}\n\n'
    assert events.feed(start) == start and events.error is None
    assert events.feed(error) == error and events.error == 500


def test_a_messages_stream_that_ends_in_an_error_event_counts_as_5xx() -> None:
    body = {"model": "m", "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    parsed = parse_agent_request(json.dumps(body).encode(), "messages")
    core = GatewayCore(GatewayConfig(), OneReplica("http://unused"))
    core.reconfigure(routing_user_config(parse_config(_stack())))
    rec = Recorder()
    ex = Exchange(
        parsed, core.routes.resolve("m"), core.auth.authenticate(None, None), in_flight=core.in_flight,
        quota=core.quota, metrics=rec,
    )  # fmt: skip
    ex.feed(b'event: message_start\ndata: {"type":"message_start","message":{"usage":{"input_tokens":3}}}\n\n')
    ex.feed(b'event: error\ndata: {"type":"error","error":{"type":"internal_error","message":"boom"}}\n\n')
    ex.finish(200)
    assert [t["status_class"] for _, t in rec.of("requests")] == ["5xx"] and rec.of("ttft") == []


# --- 2. requests refused before they are forwarded -------------------------------------------------


async def _ok(request: web.Request) -> web.Response:
    return web.json_response({"id": "c", "object": "text_completion", "choices": [], "usage": {}})


async def test_requests_refused_before_forwarding_are_counted_with_bounded_labels() -> None:
    keys = {"mode": "keys", "tenants": [{"name": "t", "key_hashes": [hash_key(KEY)]}]}
    settings = GatewayConfig(max_migrations=0, max_body_bytes=4096)
    async with gateway(_ok, settings, _stack(keys)) as (c, core, rec):
        ok = {"model": "m", "prompt": "hi", "max_tokens": 1}
        statuses = [
            (await c.post("/v1/completions", json=ok)).status_code,  # no key
            (await c.post("/v1/completions", json={**ok, "model": "secret-client-model"}, headers=AUTH)).status_code,
            (await c.post("/v1/completions", json={**ok, "max_tokens": "x"}, headers=AUTH)).status_code,
            (await c.post("/v1/completions", json={**ok, "prompt": "x" * 5000}, headers=AUTH)).status_code,
        ]
        core.quota.failure_mode = "closed"

        async def broken(tenant: str, *args: Any, **kwargs: Any) -> Any:  # the quota actor timed out
            return core.quota._failed(tenant, TimeoutError())

        core.quota.admit = broken  # type: ignore[method-assign]
        statuses.append((await c.post("/v1/completions", json=ok, headers=AUTH)).status_code)

        def crash(*args: Any) -> Any:
            raise RuntimeError("a bug")

        core.quota.admit = _admit_nothing  # type: ignore[method-assign]
        core.hint_for = crash  # type: ignore[method-assign]
        statuses.append((await c.post("/v1/completions", json=ok, headers=AUTH)).status_code)
    assert statuses == [401, 404, 400, 413, 503, 500]
    assert [t for _, t in rec.of("refused")] == [
        {"tenant": "-", "status_class": "4xx", "reason": "invalid_api_key"},
        {"tenant": "t", "status_class": "4xx", "reason": "model_not_found"},
        {"tenant": "t", "status_class": "4xx", "reason": "invalid_request_error"},
        {"tenant": "t", "status_class": "4xx", "reason": "invalid_request_error"},
        {"tenant": "t", "status_class": "5xx", "reason": "service_unavailable"},
        {"tenant": "t", "status_class": "5xx", "reason": "server_error"},
    ]
    assert rec.of("requests") == []  # none reached an exchange


async def _admit_nothing(*args: Any, **kwargs: Any) -> tuple[dict[str, str], int]:
    return {}, 0


async def test_rate_limited_shed_and_forwarded_failures_are_not_counted_as_refused() -> None:
    async def failing(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "boom", "type": "InternalServerError", "code": 500}}, status=500)

    low = {"mode": "keys", "tenants": [{"name": "low", "key_hashes": [hash_key(KEY)], "priority": 2}]}
    async with gateway(failing, stack=_stack(low)) as (c, core, rec):
        body = {"model": "m", "prompt": "hi", "max_tokens": 1}

        async def limited(*args: Any, **kwargs: Any) -> Any:
            raise RateLimited("Rate limit reached.", code="rate_limit_requests")

        real = core.quota.admit
        core.quota.admit = limited  # type: ignore[method-assign]
        assert (await c.post("/v1/completions", json=body, headers=AUTH)).status_code == 429
        core.quota.admit = real  # type: ignore[method-assign]
        core.in_flight["m"] = core.routes.models["m"].shed_low_priority_at  # busy: low priority is shed
        assert (await c.post("/v1/completions", json=body, headers=AUTH)).status_code == 503
        core.in_flight["m"] = 0
        assert (await c.post("/v1/completions", json=body, headers=AUTH)).status_code == 500  # the engine's own
    assert rec.of("refused") == []
    assert len(rec.of("rate_limited")) == 1 and len(rec.of("shed")) == 1
    assert [t["status_class"] for _, t in rec.of("requests")] == ["5xx"]


# --- 3-5. the in-flight gauge, TTFT from arrival, ITL per choice ---------------------------------


async def test_the_in_flight_gauge_is_set_when_a_request_starts() -> None:
    release = asyncio.Event()

    async def slow(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(ev(FIRST))
        await release.wait()
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async with gateway(slow) as (c, _, rec):
        task = asyncio.ensure_future(c.post("/v1/completions", json={"model": "m", "prompt": "hi", "stream": True}))
        for _ in range(200):
            if rec.of("in_flight"):
                break
            await asyncio.sleep(0.01)
        assert rec.of("in_flight") == [(1, {"model": "m", "kind": "all"})]
        release.set()
        await task
    assert [v for v, _ in rec.of("in_flight")] == [1, 0]


async def test_ttft_and_latency_start_at_arrival_and_include_admission() -> None:
    async def fast(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(ev(FIRST) + b"data: [DONE]\n\n")
        return resp

    async with gateway(fast) as (c, core, rec):
        real = core.quota.admit

        async def slow_admit(*args: Any, **kwargs: Any) -> Any:  # a quota actor slow to answer
            await asyncio.sleep(0.3)
            return await real(*args, **kwargs)

        core.quota.admit = slow_admit  # type: ignore[method-assign]
        t0 = time.monotonic()
        await c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 1, "stream": True})
        took = time.monotonic() - t0
    ((ttft, _),) = rec.of("ttft")
    ((e2e, _),) = rec.of("e2e")
    assert 0.3 <= ttft <= e2e <= took


async def test_itl_divides_the_span_by_the_tokens_of_one_choice() -> None:
    """n=2: two choices of 10 tokens generated together, 50 ms a step: the ITL is ~50 ms, not ~25."""

    async def two(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(10):
            step = [ev({"choices": [{"index": j, "text": f" {i}"}]}) for j in (0, 1)]
            await resp.write(b"".join(step))
            if i < 9:
                await asyncio.sleep(0.05)
        usage = {"prompt_tokens": 2, "completion_tokens": 20, "total_tokens": 22}
        await resp.write(ev({"choices": [], "usage": usage}) + b"data: [DONE]\n\n")
        return resp

    body = {"model": "m", "prompt": "hi", "max_tokens": 10, "n": 2, "stream": True}
    async with gateway(two) as (c, _, rec):
        await c.post("/v1/completions", json={**body, "stream_options": {"include_usage": True}})
    ((itl, _),) = rec.of("itl")
    assert 0.045 <= itl < 0.1, itl


def test_itl_is_skipped_when_each_choice_has_one_token() -> None:
    body = {"model": "m", "prompt": ["a", "b"], "max_tokens": 1, "n": 2, "stream": True}
    core = GatewayCore(GatewayConfig(), OneReplica("http://unused"))
    core.reconfigure(routing_user_config(parse_config(_stack())))
    rec = Recorder()
    ex = Exchange(
        parse_request(json.dumps(body).encode(), "completion"), core.routes.resolve("m"),
        core.auth.authenticate(None, None), in_flight=core.in_flight, quota=core.quota, metrics=rec,
    )  # fmt: skip
    ex.feed(ev({"choices": [{"index": i, "text": "x"} for i in range(4)]}))
    ex.feed(ev({"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}}))
    ex.finish(200)
    assert len(rec.of("ttft")) == 1 and rec.of("itl") == []  # 4 tokens over 2 prompts x n=2: one each
