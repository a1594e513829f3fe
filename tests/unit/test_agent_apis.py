"""The agent APIs' pure parts (store bounds, expansion, stream taps, billing, error shapes) and the
gateway's Responses/Messages routes in-process: the real gateway app and relay over loopback HTTP
to a replica that records what it was sent, with the response store's actor run in-process."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import pytest
from aiohttp import web

from loadtests.relay import OneReplica
from serving.config import GatewayConfig, ResponseStoreConfig, parse_config
from serving.control.serve_config import routing_user_config
from serving.errors import (
    AuthenticationError,
    NotFound,
    RateLimited,
    Unavailable,
    UpstreamError,
    sse_error_event,
    to_response,
)
from serving.gateway.admission.auth import Tenant, hash_key
from serving.gateway.admission.quota import QuotaActor, QuotaClient
from serving.gateway.agent_protocol import EventTap, parse_agent_request
from serving.gateway.api import create_api
from serving.gateway.conversations import ResponseLog, ResponseStore, ResponseStoreActor, expand
from serving.gateway.core import GatewayCore
from tests.support.actors import LocalActor
from tests.support.kv import MemoryKV

# -- the store ----------------------------------------------------------------------------------


def test_the_log_is_bounded_per_tenant_by_count_bytes_and_time() -> None:
    log = ResponseLog()
    for i in range(4):
        log.put("a", f"r{i}", b"x" * 10, expires=100.0, max_items=3, max_bytes=1000)
    assert log.count("a") == 3 and log.get("a", "r0", 0) is None and log.get("a", "r3", 0) == b"x" * 10
    assert log.put("a", "big", b"y" * 25, expires=100.0, max_items=10, max_bytes=40) == ["r1", "r2"]
    assert log.get("b", "r3", 0) is None  # another tenant's id is nobody's
    assert log.put("a", "huge", b"z" * 41, expires=100.0, max_items=10, max_bytes=40) is None  # evicts nothing
    assert log.count("a") == 2 and log.get("a", "huge", 0) is None
    assert log.get("a", "r3", 100.0) is None  # expired
    assert log.expired(100.0) == [("a", "r3"), ("a", "big")] and log.count("a") == 0


def test_a_store_whose_one_response_outgrows_a_tenants_bytes_is_refused() -> None:
    with pytest.raises(ValueError, match=r"max_response_bytes \(4096\) is over max_bytes_per_tenant \(2048\)"):
        ResponseStoreConfig(max_response_bytes=4096, max_bytes_per_tenant=2048)


def test_stored_responses_survive_an_actor_restart_and_evictions_leave_the_kv() -> None:
    kv = MemoryKV()
    first = ResponseStoreActor(kv, sweep_s=0)
    first.put("t", "r1", b'{"a":1}', 3600, 2, 1 << 20)
    first.put("t", "r2", b'{"a":2}', 3600, 2, 1 << 20)
    first.put("t", "r3", b'{"a":3}', 3600, 2, 1 << 20)
    assert sorted(kv.data) == ["responses/t/r2", "responses/t/r3"]
    again = ResponseStoreActor(kv, sweep_s=0)  # what Ray's restart runs
    assert again.get("t", "r3") == b'{"a":3}' and again.get("u", "r3") is None
    assert again.delete("t", "r2") and sorted(kv.data) == ["responses/t/r3"]
    first.put("t", "old", b"{}", -1, 5, 1 << 20)
    assert first.get("t", "old") is None and first.sweep() == 1


async def test_a_store_that_does_not_answer_is_a_503_and_large_records_are_not_kept() -> None:
    class Hung:
        def __getattr__(self, name: str) -> Any:
            class _Call:
                @staticmethod
                def remote(*args: Any) -> Any:
                    return asyncio.get_running_loop().create_future()

            return _Call

    store = ResponseStore(ResponseStoreConfig(timeout_s=0.1), actor=Hung())
    with pytest.raises(Unavailable):
        await store.get("t", "r")
    assert await store.put("t", "r", {"response": {}, "items": []}) is False
    small = ResponseStore(
        ResponseStoreConfig(max_response_bytes=1024), actor=LocalActor(ResponseStoreActor(MemoryKV(), 0))
    )
    assert await small.put("t", "r", {"items": ["x" * 2000]}) is False and await small.get("t", "r") is None


def test_a_follow_up_carries_the_history_as_input_items() -> None:
    previous = {"items": [{"type": "message", "role": "user", "content": "1+1="}, {"type": "message", "id": "m"}]}
    body = {"model": "m", "input": "and 2+2=", "previous_response_id": "resp_1", "instructions": "be brief"}
    out, items = expand(body, previous)
    assert "previous_response_id" not in out and out["store"] is False and out["instructions"] == "be brief"
    assert out["input"] == items == [*previous["items"], {"type": "message", "role": "user", "content": "and 2+2="}]
    assert expand({"input": [{"type": "message", "role": "user", "content": "x"}]}, None)[1][0]["content"] == "x"


# -- taps and billing ---------------------------------------------------------------------------


def _events(*events: tuple[str, dict[str, Any]]) -> bytes:
    return b"".join(f"event: {n}\ndata: {json.dumps(d)}\n\n".encode() for n, d in events)


def test_the_responses_tap_passes_bytes_and_keeps_the_final_usage_and_response() -> None:
    final = {"id": "resp_1", "output": [], "usage": {"input_tokens": 7, "output_tokens": 3, "total_tokens": 10}}
    stream = _events(
        ("response.created", {"type": "response.created", "response": {"id": "resp_1", "usage": None}}),
        ("response.output_text.delta", {"type": "response.output_text.delta", "delta": "4"}),
        ("response.completed", {"type": "response.completed", "response": final}),
    )
    tap = EventTap("responses")
    out = b"".join(tap.feed(stream[i : i + 7]) for i in range(0, len(stream), 7)) + tap.flush()
    assert out == stream and tap.response == final and tap.usage == final["usage"] and tap.counts_output
    req = parse_agent_request(b'{"model":"m","input":"x","stream":true}', "responses")
    assert req.tokens(final["usage"]) == (7, 3) and req.reserve_tokens(512) == (0, 512)


def test_the_error_event_that_ends_a_broken_responses_stream_is_numbered_after_the_last() -> None:
    tap = EventTap("responses")
    for n, name in enumerate(("response.created", "response.in_progress", "response.output_text.delta")):
        tap.feed(_events((name, {"type": name, "sequence_number": n})))
    event = sse_error_event(UpstreamError("cut"), "rid-1", "responses", tap.sequence + 1)
    data = json.loads(event.decode().partition("data: ")[2])
    assert data["type"] == "error" and data["sequence_number"] == 3  # OpenAI's ResponseErrorEvent requires it


def test_messages_bill_every_usage_field_and_count_tokens_bills_none() -> None:
    stream = _events(
        ("message_start", {"type": "message_start", "message": {"usage": {"input_tokens": 2, "output_tokens": 0}}}),
        ("content_block_delta", {"type": "content_block_delta", "delta": {"text": "42"}}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "usage": {
                    "input_tokens": 2,
                    "output_tokens": 5,
                    "cache_read_input_tokens": 16,
                    "cache_creation_input_tokens": 1,
                },
            },
        ),
    )
    tap = EventTap("messages")
    head = stream.index(b"event: content_block_delta")  # message_start's usage counts no output yet
    assert tap.feed(stream[:head]) == stream[:head] and tap.usage is not None and not tap.counts_output
    assert tap.feed(stream[head:]) == stream[head:] and tap.counts_output
    req = parse_agent_request(b'{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"x"}]}', "messages")
    assert (
        req.tokens(tap.usage) == (2 + 16 + 1, 5)
        and req.reserve_tokens(512) == (33 + 64, 8)  # its messages as JSON and the template
        and req.error_shape == "anthropic"
    )
    count = parse_agent_request(b'{"model":"m","messages":[{"role":"user","content":"x"}]}', "count_tokens")
    assert not count.bills_tokens and count.tokens({"input_tokens": 9}) == (0, 0)
    assert not parse_agent_request(b'{"model":"m","prompt":"x"}', "tokenize").bills_tokens


@pytest.mark.parametrize(
    "body,kind",
    [
        (b'{"model":"m"}', "responses"),
        (b'{"model":"m","input":"x","background":true}', "responses"),
        (b'{"model":"m","input":"x","store":"false"}', "responses"),  # kept for a day if read as true
        (b'{"model":"m","input":"x","store":0}', "responses"),
        (b'{"model":"m","input":"x","previous_response_id":""}', "responses"),  # not a fresh start, silently
        (b'{"model":"m","input":"x","conversation":"conv_1"}', "responses"),  # vLLM would ignore it
        (b'{"model":"m","messages":[]}', "messages"),
        (b'{"model":"m","messages":[{"role":"user","content":"x"}]}', "messages"),  # max_tokens required
        (b'{"model":"m","tokens":["a"]}', "detokenize"),
        (b'{"model":"m"}', "tokenize"),
    ],
)
def test_malformed_agent_requests_are_400(body: bytes, kind: Any) -> None:
    with pytest.raises(Exception) as exc:
        parse_agent_request(body, kind)
    assert getattr(exc.value, "status", None) == 400


# -- error shapes -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "exc,status,type_",
    [
        (AuthenticationError("no key"), 401, "authentication_error"),
        (NotFound("no model"), 404, "not_found_error"),
        (RateLimited("slow down"), 429, "rate_limit_error"),
        (Unavailable("busy"), 503, "overloaded_error"),
        (ValueError("boom"), 500, "api_error"),
    ],
)
def test_anthropic_routes_render_errors_in_anthropics_shape(exc: Exception, status: int, type_: str) -> None:
    resp = to_response(exc, "rid-1", "anthropic")
    body = msgspec.json.decode(resp.body)
    assert resp.status == status and body == {
        "type": "error",
        "error": {"type": type_, "message": body["error"]["message"]},
    }
    assert (status < 500) or "rid-1" in body["error"]["message"]
    event = sse_error_event(exc, "rid-1", "anthropic")
    assert event.startswith(b"event: error\ndata: ") and event.endswith(b"\n\n")


def test_streamed_response_objects_show_the_clients_conversation_fields() -> None:
    """The engine is sent ``store: false`` and no previous id; the client's events say what it asked."""
    from serving.gateway.agent_routes import restate

    created = b'event: response.created\ndata: {"type":"response.created","response":{"id":"r","store":false}}\n\n'
    delta = b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"4"}\n\n'
    done = b'event: response.completed\ndata: {"type":"response.completed","response":{"id":"r","store":false,'
    done += b'"previous_response_id":null}}\n\n'
    out = restate(created + delta + done, "resp_1", True)
    events = [e for e in out.split(b"\n\n") if e]
    assert len(events) == 3 and events[1] == delta[:-2] and out.endswith(b"\n\n")
    for ev in (events[0], events[2]):
        response = json.loads(ev.partition(b"\ndata: ")[2])["response"]
        assert response == {"id": "r", "store": True, "previous_response_id": "resp_1"}
    assert restate(delta, "resp_1", True) == delta


async def test_a_streamed_answer_the_store_did_not_keep_ends_with_store_false() -> None:
    from serving.gateway.agent_routes import ResponsesFlow, Turn

    class Refusing:  # full, too large or unavailable: put says it kept nothing
        async def put(self, tenant: str, rid: str, record: dict[str, Any]) -> bool:
            return False

    async def upstream() -> AsyncIterator[bytes]:
        yield b'event: response.created\ndata: {"type":"response.created","response":{"id":"r"}}\n\n'
        yield b'event: response.completed\ndata: {"type":"response.completed","response":{"id":"r"}}\n\n'

    tenant = Tenant("a", frozenset({"m"}))
    chunks = [c async for c in ResponsesFlow(Refusing())._storing(upstream(), Turn([], None, True), tenant)]  # type: ignore[arg-type]
    first, last = (json.loads(c.partition(b"\ndata: ")[2])["response"]["store"] for c in chunks)
    assert (first, last) == (True, False)


# -- the routes in-process ----------------------------------------------------------------------

KEYS = {"a": "sk-a", "b": "sk-b"}
STACK = {
    "auth": {
        "mode": "keys",
        "tenants": [
            {"name": "a", "key_hashes": [hash_key(KEYS["a"])], "models": ["m"]},
            {"name": "b", "key_hashes": [hash_key(KEYS["b"])], "models": ["m"], "rpm": 2},
        ],
    },
    "models": [{"name": "m", "engine": {"max_model_len": 64}, "versions": [{"version": "v1"}]}],
}


@contextlib.asynccontextmanager
async def _stack(
    settings: GatewayConfig | None = None,
) -> AsyncIterator[tuple[httpx.AsyncClient, list[dict[str, Any]]]]:
    """The gateway over a loopback replica that answers Responses and Messages like vLLM and
    records each body it was sent."""
    seen: list[dict[str, Any]] = []

    async def responses(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        n = len(seen)
        out = [{"type": "message", "id": f"msg_{n}", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": f"answer {n}", "annotations": []}]}]  # fmt: skip
        usage = {"input_tokens": 3 * len(body["input"]), "output_tokens": 2, "total_tokens": 3 * len(body["input"]) + 2}
        return web.json_response({"id": f"resp_{n}", "object": "response", "output": out, "usage": usage})

    async def messages(request: web.Request) -> web.Response:
        seen.append(await request.json())
        err = {"type": "error", "error": {"type": "BadRequestError", "message": "bad role"}}
        return web.json_response(err, status=400)

    app = web.Application()
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/v1/messages", messages)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    actor = LocalActor(ResponseStoreActor(MemoryKV(), 0))
    settings = settings or GatewayConfig(expose_replica_header=True)
    core = GatewayCore(settings, OneReplica(url), replica_id="gw-1", response_store_actor=actor)
    core.quota = QuotaClient(60, LocalActor(QuotaActor(MemoryKV(), checkpoint_s=0)))  # kept by reconfigure
    core.reconfigure(routing_user_config(parse_config(STACK)))
    transport = httpx.ASGITransport(app=create_api(core, set_request_id_header=True))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
            yield c, seen
    finally:
        await core.aclose()
        await runner.cleanup()


async def test_the_gateway_keeps_responses_per_tenant_and_expands_follow_ups() -> None:
    a = {"authorization": f"Bearer {KEYS['a']}"}
    async with _stack() as (c, seen):
        r1 = await c.post("/v1/responses", json={"model": "m", "input": "1+1="}, headers=a)
        assert r1.status_code == 200 and r1.json()["store"] is True
        assert seen[0]["store"] is False and seen[0]["input"][0]["content"] == "1+1="
        r2 = await c.post(
            "/v1/responses", json={"model": "m", "input": "2+2=", "previous_response_id": "resp_1"}, headers=a
        )
        assert r2.status_code == 200 and r2.json()["previous_response_id"] == "resp_1"
        # the engine got the whole conversation as input items, and no previous_response_id
        assert [i.get("content") if i.get("role") == "user" else i["id"] for i in seen[1]["input"]] == [
            "1+1=", "msg_1", "2+2="]  # fmt: skip
        assert "previous_response_id" not in seen[1]
        got = await c.get("/v1/responses/resp_2", headers={"x-api-key": KEYS["a"]})
        assert got.status_code == 200 and got.json()["output"][0]["id"] == "msg_2"
        assert got.headers["x-gateway-replica"] == "gw-1"  # which gateway replica answered (debug header)
        other = await c.get("/v1/responses/resp_2", headers={"authorization": f"Bearer {KEYS['b']}"})
        assert other.status_code == 404 and set(other.json()["error"]) == {"message", "type", "param", "code"}
        cancel = await c.post("/v1/responses/resp_2/cancel", headers=a)
        assert cancel.status_code == 400
        assert (await c.delete("/v1/responses/resp_2", headers=a)).json()["deleted"] is True
        assert (await c.get("/v1/responses/resp_2", headers=a)).status_code == 404
        missing = await c.post(
            "/v1/responses", json={"model": "m", "input": "x", "previous_response_id": "resp_9"}, headers=a
        )
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "previous_response_id"
        assert len(seen) == 2  # neither a retrieval nor an unknown follow-up reached the engine


async def test_an_answer_too_large_to_store_says_store_false() -> None:
    a = {"authorization": f"Bearer {KEYS['a']}"}
    settings = GatewayConfig(responses=ResponseStoreConfig(max_response_bytes=1024))
    async with _stack(settings) as (c, _):
        small = await c.post("/v1/responses", json={"model": "m", "input": "1+1="}, headers=a)
        assert small.json()["store"] is True and (await c.get("/v1/responses/resp_1", headers=a)).status_code == 200
        large = await c.post("/v1/responses", json={"model": "m", "input": "x" * 2000}, headers=a)
        assert large.status_code == 200 and large.json()["store"] is False  # nothing to follow up on
        assert (await c.get("/v1/responses/resp_2", headers=a)).status_code == 404


async def test_messages_routes_answer_in_anthropics_shape_with_either_key_header() -> None:
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "robot", "content": "x"}]}
    async with _stack() as (c, seen):
        none = await c.post("/v1/messages", json=body)
        assert none.status_code == 401 and none.json()["error"]["type"] == "authentication_error"
        engine = await c.post("/v1/messages", json=body, headers={"x-api-key": KEYS["a"]})
        assert engine.status_code == 400 and engine.json() == {
            "type": "error", "error": {"type": "invalid_request_error", "message": "bad role"}}  # fmt: skip
        absent = await c.post("/v1/messages", json={**body, "model": "nope"}, headers={"x-api-key": KEYS["a"]})
        assert absent.status_code == 404 and absent.json()["error"]["type"] == "not_found_error"
        b = {"authorization": f"Bearer {KEYS['b']}"}
        codes = [(await c.post("/v1/messages", json=body, headers=b)).status_code for _ in range(3)]
        assert codes == [400, 400, 429]
        limited = await c.post("/v1/messages", json=body, headers=b)
        assert limited.json()["error"]["type"] == "rate_limit_error" and limited.headers["retry-after"]


def test_either_key_header_names_the_tenant_and_bearer_wins() -> None:
    from serving.config import AuthConfig
    from serving.gateway.admission.auth import Authenticator

    auth = Authenticator(AuthConfig.model_validate(STACK["auth"]))
    assert auth.authenticate(None, KEYS["a"]).name == "a"
    assert auth.authenticate(f"Bearer {KEYS['b']}", KEYS["a"]).name == "b"
    with pytest.raises(AuthenticationError):
        auth.authenticate(None, "sk-wrong")
    with pytest.raises(AuthenticationError):
        auth.authenticate(None, " ")


def test_model_cards_carry_the_versions_manifest_time_and_capabilities() -> None:
    from serving.gateway.routing import GatewayRoutes, RoutingTable

    stack = {**STACK, "models": [{**STACK["models"][0], "aliases": ["alias"], "versions": [
        {"version": "v1", "weight": 10}, {"version": "v2", "weight": 90}]}]}  # fmt: skip
    cfg = parse_config(stack)
    routes = routing_user_config(cfg, lambda m, v: {"v1": 1_700_000_001, "v2": 1_700_000_002}[v.version])
    table = RoutingTable.from_routes(GatewayRoutes.model_validate(routes))
    cards = {i: table.model_card(i) for i, _ in table.model_ids()}
    assert cards["m@v1"]["created"] == 1_700_000_001
    assert cards["m"]["created"] == cards["alias"]["created"] == 1_700_000_002  # the live version's
    assert "responses" in cards["m"]["capabilities"]  # type: ignore[operator]
    assert routing_user_config(cfg)["models"][0]["versions"][0]["created"] == 0


def test_requests_without_leading_text_still_get_a_prefix_affinity_hint() -> None:
    """ray.serve.llm's PrefixCacheAffinityRouter divides by the hint's length (found by the
    integration test: a /detokenize to subtractor hung with its ZeroDivisionError)."""
    from serving.gateway.core import NO_PROMPT
    from serving.gateway.protocol import parse_request
    from serving.gateway.routing import GatewayRoutes, RoutingTable

    stack = {**STACK, "models": [{**STACK["models"][0], "deployment": {"router": "prefix_affinity"}}]}
    table = RoutingTable.from_routes(GatewayRoutes.model_validate(routing_user_config(parse_config(stack))))
    core = GatewayCore(GatewayConfig(), OneReplica("http://unused"))
    resolved = table.resolve("m")
    parts = b'{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"x"}]}]}'
    for parsed in (parse_agent_request(b'{"model":"m","tokens":[1,2]}', "detokenize"), parse_request(parts, "chat")):
        assert core.hint_for(resolved, parsed, None).prompt == NO_PROMPT
    tokenize = parse_agent_request(b'{"model":"m","prompt":"50-8="}', "tokenize")
    assert core.hint_for(resolved, tokenize, None).prompt == "50-8="
