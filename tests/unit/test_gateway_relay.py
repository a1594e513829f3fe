"""The gateway's relay, end to end on loopback: a real uvicorn listener serving the gateway app,
a real HTTP replica streaming SSE (aiohttp), real sockets in between. What it pins down: the
bytes arrive as the replica sent them (usage hidden unless asked), and a client that goes away,
mid-stream or before the first event, ends the replica's request and releases the replica at once."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from aiohttp import web

from loadtests.relay import OneReplica
from serving.config import GatewayConfig, parse_config
from serving.control.serve_config import routing_user_config
from serving.gateway.api import create_api
from serving.gateway.core import GatewayCore
from serving.gateway.listener import Listener
from serving.replica.node import free_port
from tests.support.loopback import http_replica

TOKENS = 40


def _event(i: int) -> bytes:
    return b"data: " + json.dumps({"choices": [{"index": 0, "text": f" t{i}"}]}).encode() + b"\n\n"


USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":40,"total_tokens":43}}\n\n'


class Replica:
    """A model replica's HTTP server: ``TOKENS`` events ``gap_s`` apart, usage, [DONE]."""

    def __init__(self, gap_s: float) -> None:
        self.gap_s = gap_s
        self.bodies: list[dict[str, Any]] = []
        self.ended: list[str] = []  # "done" or "client gone", per request

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(TOKENS):
                await resp.write(_event(i))
                await asyncio.sleep(self.gap_s)
            await resp.write(USAGE + b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self.ended.append("client gone")
            raise
        self.ended.append("done")
        return resp


class SlowFirstEvent:
    """A replica that sends its response head at once and no event for a long while (a long
    prefill), watching its connection: ``closed_after`` holds how long after the head it closed."""

    def __init__(self) -> None:
        self.closed_after: list[float] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        loop = asyncio.get_running_loop()
        start = loop.time()
        while loop.time() - start < 10:
            transport = request.transport
            if transport is None or transport.is_closing():  # vLLM aborts a request whose connection closes
                self.closed_after.append(loop.time() - start)
                break
            await asyncio.sleep(0.02)
        return resp


@contextlib.asynccontextmanager
async def _stack(gap_s: float, replica: Any = None) -> AsyncIterator[tuple[str, Any, OneReplica, GatewayCore]]:
    replica = replica or Replica(gap_s)
    async with http_replica(replica.handle) as replica_url:
        leases = OneReplica(replica_url)
        core = GatewayCore(GatewayConfig(), leases)
        stack = {"auth": {"mode": "open"}, "models": [{"name": "m", "versions": [{"version": "v1"}]}]}
        core.reconfigure(routing_user_config(parse_config(stack)))
        port = free_port()
        listener = Listener(create_api(core, set_request_id_header=True), "127.0.0.1", port, drain_s=2)
        await listener.start()
        try:
            yield f"http://127.0.0.1:{port}", replica, leases, core
        finally:
            await listener.stop()
            await core.aclose()


async def _until(check: Any, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if check():
            return
        await asyncio.sleep(0.02)
    assert check()


async def test_a_stream_is_relayed_as_sent_with_usage_hidden_unless_asked() -> None:
    async with _stack(gap_s=0.0) as (url, replica, leases, core):
        async with httpx.AsyncClient(timeout=10) as c:
            plain = await c.post(url + "/v1/completions", json={"model": "m", "prompt": "hi", "stream": True})
            asked = await c.post(
                url + "/v1/completions",
                json={"model": "m", "prompt": "hi", "stream": True, "stream_options": {"include_usage": True}},
            )
        events = b"".join(_event(i) for i in range(TOKENS))
        assert plain.status_code == 200 and plain.headers["content-type"].startswith("text/event-stream")
        assert plain.headers["x-model-version"] == "v1" and plain.headers["x-request-id"]
        assert plain.content == events + b"data: [DONE]\n\n"  # usage asked for upstream, hidden here
        assert asked.content == events + USAGE + b"data: [DONE]\n\n"
        assert all(b["stream_options"]["include_usage"] for b in replica.bodies)
        assert replica.ended == ["done", "done"] and leases.released == [False, False]
        assert core.in_flight["m"] == 0


async def test_a_client_that_goes_away_mid_stream_ends_the_replica_request() -> None:
    async with _stack(gap_s=0.05) as (url, replica, leases, core):
        async with httpx.AsyncClient(timeout=10) as c:
            async with c.stream(
                "POST", url + "/v1/completions", json={"model": "m", "prompt": "hi", "stream": True}
            ) as resp:
                got = b""
                async for chunk in resp.aiter_raw():
                    got += chunk
                    if got.count(b"\n\n") >= 3:
                        break  # leave after three tokens; closing the stream closes the connection
        assert got.startswith(_event(0))
        # The replica's request ends long before its 40 x 50 ms, and the replica is released.
        await _until(lambda: replica.ended == ["client gone"] and leases.released == [False], 1.5)
        assert core.in_flight["m"] == 0
        async with httpx.AsyncClient(timeout=10) as c:  # and the gateway serves the next one
            again = await c.post(url + "/v1/completions", json={"model": "m", "prompt": "hi", "stream": True})
        assert again.status_code == 200 and again.content.endswith(b"data: [DONE]\n\n")


async def test_a_client_that_goes_away_before_the_first_event_closes_the_replica_connection() -> None:
    async with _stack(0.0, SlowFirstEvent()) as (url, replica, leases, core):
        async with httpx.AsyncClient(timeout=httpx.Timeout(10, read=0.3)) as c:
            with pytest.raises(httpx.ReadTimeout):  # the client gives up waiting; its connection closes
                await c.post(url + "/v1/completions", json={"model": "m", "prompt": "hi", "stream": True})
        # the replica sees its connection close at once (its engine stops), not when garbage is collected
        await _until(lambda: replica.closed_after != [], 3.0)
        assert replica.closed_after[0] < 1.5
        assert leases.released == [False] and core.in_flight["m"] == 0
