"""What the gateway retries, on loopback: a real HTTP replica (aiohttp) behind the real gateway app
and relay. Only failures that are safe to resend are retried (and mark the replica failed); an
engine's own error answer reaches the client once and leaves the replica in rotation."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
from aiohttp import web

from loadtests.relay import OneReplica
from serving.config import GatewayConfig, parse_config
from serving.control.serve_config import routing_user_config
from serving.gateway.api import create_api
from serving.gateway.core import GatewayCore
from serving.gateway.relay import RetryBudget
from serving.replica.node import free_port
from tests.support.loopback import http_replica

BODY = {"model": "m", "prompt": "1+1=", "max_tokens": 2}
ANSWER = {"choices": [{"index": 0, "text": "2"}], "usage": {"prompt_tokens": 4, "completion_tokens": 1}}
ROUTES = routing_user_config(
    parse_config(
        {
            "auth": {"mode": "open"},
            "models": [{"name": "m", "engine": {"max_model_len": 64}, "versions": [{"version": "v1"}]}],
        }
    )
)


@contextlib.asynccontextmanager
async def _gateway(url: str, **settings: Any) -> AsyncIterator[tuple[httpx.AsyncClient, OneReplica]]:
    leases = OneReplica(url)
    core = GatewayCore(GatewayConfig(expose_replica_header=True, **settings), leases)
    core.reconfigure(ROUTES)
    transport = httpx.ASGITransport(app=create_api(core, set_request_id_header=True))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=20) as c:
            yield c, leases
    finally:
        await core.aclose()


async def test_an_engine_error_reaches_the_client_once_and_the_replica_stays() -> None:
    hits: list[int] = []

    async def handler(request: web.Request) -> web.Response:
        hits.append(1)
        err = {"error": {"message": "grammar rejected tokens", "type": "InternalServerError", "code": 500}}
        return web.json_response(err, status=500)

    async with http_replica(handler) as url, _gateway(url, retries=3) as (c, leases):
        r = await c.post("/v1/completions", json=BODY, headers={"x-request-id": "rid-500"})
    assert r.status_code == 500 and len(hits) == 1 and r.headers["x-upstream-attempts"] == "1"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "server_error"
    assert "grammar rejected tokens" in err["message"] and "rid-500" in err["message"]
    assert leases.released == [False]  # not marked failed


async def test_an_error_from_a_replica_that_then_fails_its_health_check_is_retried() -> None:
    """A replica shutting down (its actor killed, its engine stopping) fails a request it had not
    begun with a 500, and its /health fails: the request is safe to send elsewhere."""
    hits: list[int] = []
    dying: list[bool] = []

    async def handler(request: web.Request) -> web.Response:
        hits.append(1)
        if len(hits) == 1:
            dying.append(True)
            return web.json_response({"error": {"message": "engine core shut down"}}, status=500)
        return web.json_response(ANSWER)

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=503 if dying and len(hits) == 1 else 200)

    async with http_replica(handler, health) as url, _gateway(url, retries=2) as (c, leases):
        r = await c.post("/v1/completions", json=BODY)
    assert r.status_code == 200 and r.headers["x-upstream-attempts"] == "2" and len(hits) == 2
    assert leases.released == [True, False]  # the dying replica was marked failed


async def test_vllm_503_is_retried_elsewhere_and_marks_the_replica() -> None:
    hits: list[int] = []

    async def handler(request: web.Request) -> web.Response:
        hits.append(1)
        if len(hits) == 1:
            return web.json_response({"error": {"message": "engine dead"}}, status=503)
        return web.json_response(ANSWER)

    async with http_replica(handler) as url, _gateway(url, retries=2) as (c, leases):
        r = await c.post("/v1/completions", json=BODY)
    assert r.status_code == 200 and r.headers["x-upstream-attempts"] == "2" and len(hits) == 2
    assert leases.released == [True, False]


async def test_only_503s_left_give_a_503_with_retry_after() -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "engine dead"}}, status=503)

    async with http_replica(handler) as url, _gateway(url, retries=1) as (c, leases):
        r = await c.post("/v1/completions", json=BODY)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "service_unavailable" and leases.released == [True, True]


async def test_connection_refused_is_retried_then_502() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    async with _gateway(url, retries=2) as (c, leases):
        r = await c.post("/v1/completions", json=BODY)
    assert r.status_code == 502 and "after 3 attempts" in r.json()["error"]["message"]
    assert leases.released == [True, True, True]


async def test_a_try_without_a_first_byte_in_time_is_abandoned_and_retried() -> None:
    seen: list[str] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        seen.append("start")
        for _ in range(250):  # answer nothing; see whether the gateway hangs up
            transport = request.transport
            if transport is None or transport.is_closing():
                seen.append("dropped")  # the gateway closed the connection: vLLM aborts the request
                break
            await asyncio.sleep(0.02)
        return web.json_response(ANSWER)

    async with http_replica(handler) as url, _gateway(url, retries=1, first_byte_timeout_s=0.3) as (c, leases):
        r = await c.post("/v1/completions", json={**BODY, "stream": True})
        for _ in range(50):
            if seen.count("dropped") == 2:
                break
            await asyncio.sleep(0.05)
    assert r.status_code == 502 and seen == ["start", "dropped", "start", "dropped"]
    assert leases.released == [True, True]


async def test_a_spent_retry_budget_stops_retries() -> None:
    hits: list[int] = []

    async def handler(request: web.Request) -> web.Response:
        hits.append(1)
        return web.json_response({"error": {"message": "engine dead"}}, status=503)

    async with (
        http_replica(handler) as url,
        _gateway(url, retries=3, retry_budget_ratio=0, retry_budget_min=1) as (
            c,
            leases,
        ),
    ):
        first = await c.post("/v1/completions", json=BODY)
        second = await c.post("/v1/completions", json=BODY)
    assert first.status_code == second.status_code == 503
    assert len(hits) == 3  # 2 tries for the first (its one budgeted retry), 1 for the second


def test_retry_budget_is_a_share_of_recent_requests() -> None:
    b = RetryBudget(ratio=0.2, min_retries=2, window_s=10)
    assert b.try_retry(now=0) and b.try_retry(now=0) and not b.try_retry(now=0)  # the floor
    for _ in range(10):
        b.request(now=1)
    assert b.try_retry(now=1) and b.try_retry(now=1) and not b.try_retry(now=1)  # + 20% of 10
    assert b.try_retry(now=11.5)  # the window moved on: the first two retries aged out


async def test_waiting_for_a_pooled_connection_is_a_503_not_a_replica_failure() -> None:
    async def handler(request: web.Request) -> web.Response:
        await asyncio.sleep(1.0)
        return web.json_response(ANSWER)

    async with (
        http_replica(handler) as url,
        _gateway(url, max_upstream_connections=1, upstream_pool_wait_s=0.2) as (c, leases),
    ):
        a, b = await asyncio.gather(c.post("/v1/completions", json=BODY), c.post("/v1/completions", json=BODY))
    assert sorted([a.status_code, b.status_code]) == [200, 503]
    busy = a if a.status_code == 503 else b
    assert "limit of open model connections" in busy.json()["error"]["message"]
    assert leases.released == [False]  # one lease, for the request served; nobody marked failed
