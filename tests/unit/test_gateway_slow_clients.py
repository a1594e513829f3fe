"""Slow, idle and leaving clients against the gateway's real listener (uvicorn on loopback, raw
sockets as clients) and a real HTTP replica (aiohttp)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from loadtests.relay import OneReplica
from serving.config import GatewayConfig, parse_config
from serving.control.serve_config import routing_user_config
from serving.gateway.admission.quota import WindowCounter
from serving.gateway.api import create_api
from serving.gateway.core import GatewayCore
from serving.gateway.listener import Listener
from serving.replica.node import free_port
from tests.support.loopback import http_replica

ROUTES = routing_user_config(
    parse_config(
        {
            "auth": {"mode": "open"},
            "models": [{"name": "m", "engine": {"max_model_len": 64}, "versions": [{"version": "v1"}]}],
        }
    )
)
BODY = b'{"model": "m", "prompt": "1+1=", "max_tokens": 2}'


@contextlib.asynccontextmanager
async def _listener(replica_url: str, **limits: Any) -> AsyncIterator[tuple[int, OneReplica, GatewayCore]]:
    leases = OneReplica(replica_url)
    core = GatewayCore(GatewayConfig(), leases)
    core.reconfigure(ROUTES)
    port = free_port()
    listener = Listener(create_api(core, set_request_id_header=True), "127.0.0.1", port, drain_s=1, **limits)
    await listener.start()
    try:
        yield port, leases, core
    finally:
        await listener.stop()
        await core.aclose()


async def _ok(request: web.Request) -> web.Response:
    return web.json_response({"choices": [{"index": 0, "text": "2"}]})


async def _read_all(reader: asyncio.StreamReader, timeout_s: float) -> bytes:
    """Everything the server sends until it closes the connection (or ``timeout_s``)."""
    return await asyncio.wait_for(reader.read(), timeout_s)


async def test_a_slowloris_client_is_cut_after_the_header_timeout() -> None:
    async with http_replica(_ok) as url, _listener(url, header_timeout_s=0.5) as (port, _, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: appl")  # half the headers
        await writer.drain()
        started = time.monotonic()
        got = await _read_all(reader, 5)  # without a header deadline this hangs and times out
        assert got.startswith(b"HTTP/1.1 408") and b'"type":"invalid_request_error"' in got
        assert time.monotonic() - started < 5
        writer.close()


async def test_a_body_that_never_completes_is_cut_after_the_body_timeout() -> None:
    async with http_replica(_ok) as url, _listener(url, body_timeout_s=0.5) as (port, _, core):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b'POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{"model"')
        await writer.drain()
        assert (await _read_all(reader, 5)).startswith(b"HTTP/1.1 408")
        writer.close()
        assert core.in_flight["m"] == 0


async def test_a_body_too_slow_on_an_anthropic_route_gets_anthropics_error_shape() -> None:
    async with http_replica(_ok) as url, _listener(url, body_timeout_s=0.5) as (port, _, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b'POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{"model"')
        await writer.drain()
        got = await _read_all(reader, 5)
        assert got.startswith(b"HTTP/1.1 408")
        error = b'{"type":"error","error":{"type":"invalid_request_error","message":"The request was not received'
        assert error in got
        writer.close()


async def test_a_kept_alive_connection_gets_the_header_deadline_again() -> None:
    async with http_replica(_ok) as url, _listener(url, header_timeout_s=0.5) as (port, _, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        request = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (len(BODY), BODY)
        writer.write(request)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200")
        await asyncio.sleep(0.8)  # idle between requests is keep_alive_s's business, not a header timeout
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")  # the next one stalls
        await writer.drain()
        rest = await _read_all(reader, 5)
        assert b"HTTP/1.1 408" in rest
        writer.close()


async def test_connections_beyond_the_limit_get_a_503_in_their_routes_shape_at_once() -> None:
    async with http_replica(_ok) as url, _listener(url, max_connections=2, header_timeout_s=0.5) as (port, _, _):
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        await asyncio.sleep(0.1)
        answers = {}
        for path in ("/v1/completions", "/v1/messages", "/v1/messages/count_tokens"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST %s HTTP/1.1\r\n" % path.encode())  # the request line is enough
            await writer.drain()
            started = time.monotonic()
            answers[path] = await _read_all(reader, 5)
            assert time.monotonic() - started < 0.4, path  # not after the header timeout
            writer.close()
        assert answers["/v1/completions"].startswith(b"HTTP/1.1 503")
        assert b'"type":"service_unavailable"' in answers["/v1/completions"]
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            assert answers[path].startswith(b"HTTP/1.1 503")
            assert (
                b'{"type":"error","error":{"type":"overloaded_error","message":"Too many connections' in answers[path]
            )
        # one that sends nothing gets OpenAI's 503 after the header timeout
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        got = await _read_all(reader, 5)
        assert got.startswith(b"HTTP/1.1 503") and b'"type":"service_unavailable"' in got
        writer.close()
        for _, w in held:  # once they close, a new connection is served
            w.close()
        await asyncio.sleep(0.1)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (len(BODY), BODY))
        await writer.drain()
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 200")
        writer.close()


async def test_a_client_leaving_a_non_streamed_request_cancels_the_engine_work() -> None:
    seen: list[str] = []

    async def slow(request: web.Request) -> web.Response:
        seen.append("start")
        for _ in range(250):  # a long generation: see whether the gateway hangs up on the engine
            transport = request.transport
            if transport is None or transport.is_closing():
                seen.append("dropped")  # vLLM aborts a request whose connection closes
                break
            await asyncio.sleep(0.02)
        return web.json_response({"choices": [{"index": 0, "text": "2"}]})

    async with http_replica(slow) as url, _listener(url) as (port, leases, core):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (len(BODY), BODY))
        await writer.drain()
        while not seen:
            await asyncio.sleep(0.02)
        writer.close()  # the client gives up while the engine works
        for _ in range(100):
            if "dropped" in seen and core.in_flight["m"] == 0:
                break
            await asyncio.sleep(0.02)
        assert seen == ["start", "dropped"] and core.in_flight["m"] == 0
        assert leases.released == [False]  # released, and the replica not blamed


def test_a_tenants_streams_are_capped_across_gateways_until_they_end() -> None:
    c = WindowCounter()
    first = [c.admit("t", None, None, 10, now=1.0, stream=True, max_streams=2) for _ in range(3)]
    assert [a.allowed for a in first] == [True, True, False] and first[2].reason == "streams"
    assert c.admit("t", None, None, 10, now=1.0, stream=False, max_streams=2).allowed  # plain requests pass
    c.record("t", 0, 10, now=2.0, ticket=first[0].ticket)  # one stream ends
    assert c.admit("t", None, None, 10, now=2.0, stream=True, max_streams=2).allowed
