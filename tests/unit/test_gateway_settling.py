"""Whatever ends a request after its admission gives its quota back: the real gateway app and relay
over a replica on loopback, with the real quota actor in process. A failure after admission, a
stream cut in the middle of an event and a client that leaves before any replica was found each
settle the tenant's token reservation and stream slot; a client that leaves an agent stream before
its final usage pays its reservation; bad values of fields the gateway reads itself are a 400, not
a 500."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from aiohttp import web

from loadtests.relay import OneReplica
from serving.gateway.admission.auth import hash_key
from serving.gateway.admission.quota import QuotaActor
from serving.gateway.api import create_api
from serving.gateway.core import GatewayCore
from serving.gateway.protocol import parse_request
from tests.support.gateway import quota_gateway
from tests.support.loopback import http_replica

KEY = "sk-t"
AUTH = {"authorization": f"Bearer {KEY}"}
STACK = {
    "auth": {
        "mode": "keys",
        "tenants": [{"name": "t", "key_hashes": [hash_key(KEY)], "models": ["m"], "tpm": 100_000, "max_streams": 2}],
    },
    "models": [{"name": "m", "engine": {"max_model_len": 64}, "versions": [{"version": "v1"}]}],
}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "1+1="}], "max_tokens": 8, "stream": True}
DELTA = {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "2"}}]}


class _Never(OneReplica):
    """No replica ever becomes free (a cold start the client gives up on)."""

    async def lease(self, *args: Any, **kwargs: Any) -> Any:
        await asyncio.Event().wait()


def _gateway(leases: OneReplica, **settings: Any) -> Any:
    return quota_gateway(leases, STACK, **settings)


def _settled(core: GatewayCore, actor: QuotaActor) -> None:
    assert core.in_flight["m"] == 0
    assert actor.counter.reserved("t", time.time()) == 0 and actor.counter.streams("t") == 0


@pytest.mark.parametrize("where", ["hint_for", "_splice"])
async def test_a_failure_after_admission_settles_the_ticket_and_the_in_flight_count(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with _gateway(OneReplica("http://127.0.0.1:9")) as (c, core, actor):

        def broken(*args: Any) -> Any:
            raise ValueError("unexpected")

        monkeypatch.setattr(core, where, broken)
        r = await c.post("/v1/chat/completions", json=CHAT, headers=AUTH)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        _settled(core, actor)


async def test_a_stream_cut_in_the_middle_of_an_event_ends_with_one_whole_error_event() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: " + json.dumps(DELTA).encode() + b"\n\n")
        await resp.write(b'data: {"id": "c", "choi')  # the engine dies halfway through an event
        await asyncio.sleep(0.2)  # let the gateway read it before the reset
        assert request.transport is not None
        request.transport.close()
        return resp

    # a stream that is not continued elsewhere (one that is drops what it held: test_gateway_migration)
    replica = http_replica(handler, path="/v1/chat/completions")
    async with replica as url, _gateway(OneReplica(url), max_migrations=0) as (c, core, actor):
        r = await c.post("/v1/chat/completions", json=CHAT, headers=AUTH)
        _settled(core, actor)
    events = [e for e in r.text.split("\n\n") if e]
    assert [e.removeprefix("data: ") for e in events][-1] == "[DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]  # each one whole JSON
    assert payloads[0] == DELTA and "error" in payloads[-1] and len(payloads) == 2


async def test_a_client_that_leaves_before_a_replica_was_found_is_not_billed() -> None:
    async with _gateway(_Never("http://127.0.0.1:9")) as (c, core, actor):
        body = parse_request(json.dumps({**CHAT, "max_tokens": 40}).encode(), "chat")
        resolved = core.routes.resolve("m")
        tenant = core.auth.authenticate(f"Bearer {KEY}", None)
        waiting = asyncio.ensure_future(core.complete(body, resolved, tenant, "/v1/chat/completions", "rid"))
        await asyncio.sleep(0.2)
        # the prompt's bound (98 bytes and template) capped at 64 - 40, and the completion's 40
        assert actor.counter.reserved("t", time.time()) == 24 + 40 and actor.counter.streams("t") == 1
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        _settled(core, actor)
        # nothing was billed: the window's whole budget is left
        assert actor.admit("t", None, 100_000, 60).remaining_tokens == 100_000


def _sse(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


# what vLLM sends before the output (Messages: the input tokens; Responses: no usage yet), then a delta
AGENT_STREAMS = {
    "/v1/messages": (
        _sse(
            "message_start", {"type": "message_start", "message": {"usage": {"input_tokens": 10, "output_tokens": 0}}}
        ),
        _sse("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {"text": "x"}}),
    ),
    "/v1/responses": (
        _sse("response.created", {"type": "response.created", "response": {"id": "resp_1", "usage": None}}),
        _sse("response.output_text.delta", {"type": "response.output_text.delta", "delta": "x"}),
    ),
}


async def _leave_after(core: GatewayCore, path: str, body: dict[str, Any], events: int) -> int:
    """POST ``body`` to the gateway app as an ASGI server would, disconnecting once ``events``
    SSE events came; returns how many came."""
    came, requests, left = [0], [json.dumps(body).encode()], asyncio.Event()

    async def receive() -> dict[str, Any]:
        if requests:
            return {"type": "http.request", "body": requests.pop(), "more_body": False}
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        came[0] += message.get("body", b"").count(b"\n\n")
        if came[0] >= events:
            left.set()

    headers = [(b"authorization", AUTH["authorization"].encode()), (b"content-type", b"application/json")]
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers, "query_string": b"", "root_path": "",
             "http_version": "1.1", "scheme": "http", "server": ("gw", 80), "client": ("c", 1)}  # fmt: skip
    await asyncio.wait_for(create_api(core)(scope, receive, send), 10)
    return came[0]


@pytest.mark.parametrize(
    ("path", "body", "billed"),
    [
        ("/v1/messages", {"max_tokens": 40, "messages": [{"role": "user", "content": "1+1="}]}, 10 + 40),
        ("/v1/responses", {"max_output_tokens": 40, "input": "1+1=", "store": False}, 24 + 40),
    ],
)
async def test_a_client_that_leaves_an_agent_stream_before_its_final_usage_pays_its_reservation(
    path: str, body: dict[str, Any], billed: int
) -> None:
    """Messages: the input tokens of message_start and the reservation for the output, never the
    input alone; Responses: the whole reservation, its prompt's share (capped at 64 - 40) and the
    output's (no usage comes before response.completed)."""
    opening, delta = AGENT_STREAMS[path]

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        try:
            await resp.write(opening)
            for _ in range(200):  # the final usage event would come after these
                await resp.write(delta)
                await asyncio.sleep(0.01)
        except ConnectionResetError:
            pass
        return resp

    async with http_replica(handler, path=path) as url, _gateway(OneReplica(url)) as (c, core, actor):
        assert await _leave_after(core, path, {"model": "m", "stream": True, **body}, events=5) < 200
        _settled(core, actor)
        assert actor.admit("t", None, 100_000, 60).remaining_tokens == 100_000 - billed


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("min_tokens", "x"),
        ("min_tokens", -1),
        ("prompt", [1, "a"]),
        ("prompt", [""]),
        ("prompt", [[]]),
        ("prompt", [-1]),
        ("prompt", [2**63]),
        ("prompt", [[1, 2], "a"]),
    ],
)
async def test_fields_the_gateway_reads_itself_are_checked_with_a_400(field: str, value: Any) -> None:
    async with _gateway(OneReplica("http://127.0.0.1:9")) as (c, core, actor):
        body = {"model": "m", "prompt": "1+1=", "max_tokens": 4, "stream": True, field: value}
        r = await c.post("/v1/completions", json=body, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == field
        _settled(core, actor)


@pytest.mark.parametrize("role", [[1, "a"], {"x": 1}, 5, None])
async def test_a_role_of_the_wrong_type_is_a_400(role: Any) -> None:
    """Found by tests/integration/test_fuzz.py: a list as role was a 500 (unhashable in the set of roles)."""
    async with _gateway(OneReplica("http://127.0.0.1:9")) as (c, core, actor):
        body = {"model": "m", "messages": [{"role": role, "content": "12+30="}], "max_tokens": 4}
        r = await c.post("/v1/chat/completions", json=body, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].role"
        _settled(core, actor)


@pytest.mark.parametrize("prompt", ["1+1=", ["1+1=", "2+2="], [1, 2, 3], [[1, 2, 3], [4, 5]]])
def test_the_four_openai_prompt_forms_are_accepted(prompt: Any) -> None:
    body = {"model": "m", "prompt": prompt, "max_tokens": 4}
    assert parse_request(json.dumps(body).encode(), "completion").body["prompt"] == prompt


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/messages/count_tokens", {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}),
    ("/tokenize", {"model": "m", "prompt": "x", "stream": True}),
    ("/detokenize", {"model": "m", "tokens": [1, 2], "stream": True}),
])  # fmt: skip
async def test_stream_is_refused_where_the_engine_answers_with_one_body(path: str, body: dict[str, Any]) -> None:
    async with _gateway(OneReplica("http://127.0.0.1:9")) as (c, core, actor):
        r = await c.post(path, json=body, headers={"x-api-key": KEY})
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and "'stream'" in error["message"]
        _settled(core, actor)
