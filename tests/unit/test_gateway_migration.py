"""Stream migration through the real gateway app, relay and splice, on loopback: two HTTP replicas
replay streams recorded from a real vLLM server (tests/unit/data/vllm_streams.json, written by
tests/support/record_streams.py). The first replica's stream breaks after ``cut`` tokens (its
connection is cut, or it sends the error event vLLM sends when its EngineCore dies and then fails
/health); the second answers only the continuation vLLM really answered to the prompt the
gateway must send. The client must see what the uninterrupted stream showed."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from loadtests.relay import FixedLease
from serving.config import GatewayConfig, parse_config
from serving.control.serve_config import routing_user_config
from serving.gateway.api import create_api
from serving.gateway.core import GatewayCore
from serving.gateway.migration import Plan, blocker, null_ids
from serving.gateway.protocol import parse_request

DATA = json.loads((Path(__file__).parent / "data" / "vllm_streams.json").read_text())
CUT = DATA["cut"]
PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}
ROUTES = routing_user_config(
    parse_config(
        {
            "auth": {"mode": "open"},
            "models": [{"name": "adder", "engine": {"max_model_len": 512}, "versions": [{"version": "v1"}]}],
        }
    )
)


def _events(raw: str) -> list[str]:
    return [e for e in raw.split("\n\n") if e]


def _ids_of(ev: str) -> int:
    if not ev.startswith("data: {"):
        return 0
    return sum(len(c.get("token_ids") or []) for c in json.loads(ev[6:])["choices"])


def _head(kind: str, cut: int = CUT) -> list[str]:
    """The recorded stream (with token ids) up to the event that completes ``cut`` tokens."""
    out, n = [], 0
    for ev in _events(DATA[kind]["with_ids"]):
        out.append(ev)
        n += _ids_of(ev)
        if n >= cut:
            return out
    raise AssertionError("the recording is shorter than the cut")


def _summary(raw: str) -> tuple[str, list[Any], list[str]]:
    """What a client reads from a stream: the text, the finish reasons and each event's shape
    (the JSON with id, timestamp, text and usage blanked, repeats dropped; vLLM batches tokens
    into chunks by timing, so the number of chunks is not a property of the answer)."""
    text, finishes, shapes = "", [], []
    for e in _normalized(raw):
        if isinstance(e, dict):
            for c in e["choices"]:
                text += c.get("text") or (c.get("delta") or {}).get("content") or ""
                finishes.append(c.get("finish_reason"))
                c.pop("text", None)
                if (c.get("delta") or {}).get("content"):
                    c["delta"]["content"] = "x"
            e.pop("usage", None)
        shape = json.dumps(e, sort_keys=True)
        if not shapes or shapes[-1] != shape:
            shapes.append(shape)
    return text, [f for f in finishes if f], shapes


def _normalized(raw: str) -> list[Any]:
    """Events as JSON with the per-request id and timestamp blanked ([DONE] as is)."""
    out: list[Any] = []
    for ev in _events(raw):
        if ev.startswith("data: {"):
            d = json.loads(ev[6:])
            d["id"], d["created"] = "ID", 0
            out.append(d)
        else:
            out.append(ev)
    return out


class Replicas:
    """Leases: the first request goes to ``urls[0]``, every later one to ``urls[1]``."""

    def __init__(self, *urls: str) -> None:
        self.urls, self.released, self.leased = list(urls), [], 0

    async def lease(
        self, app: str, hint: object, timeout_s: float, limit: int = 0, loaded_first: bool = True
    ) -> FixedLease:
        url = self.urls[min(self.leased, len(self.urls) - 1)]
        self.leased += 1
        return FixedLease(url, self.released)

    async def ready(self, app: str, timeout_s: float) -> bool:
        return True


@contextlib.asynccontextmanager
async def _replica(events: list[str], *, then: str = "cut", health: int = 200) -> AsyncIterator[tuple[str, list[Any]]]:
    """A replica that streams ``events``, then ends (``then``: "end"), or closes the connection
    ("cut"); ``health``: what its /health answers. Yields its URL and the bodies it received."""
    bodies: list[Any] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.json())
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for ev in events:
            await resp.write(ev.encode() + b"\n\n")
        if then == "cut":
            # let the gateway (same event loop) read what was sent: data that arrives together
            # with the reset is dropped by aiohttp's reader, as on a real cut
            await asyncio.sleep(0.2)
            assert request.transport is not None
            request.transport.close()
            return resp
        await resp.write_eof()
        return resp

    async def healthz(request: web.Request) -> web.Response:
        return web.Response(status=health)

    app = web.Application()
    for path in PATHS.values():
        app.router.add_post(path, handle)
    app.router.add_get("/health", healthz)
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", bodies
    finally:
        await runner.cleanup()


class Counted:
    """A stand-in for the gateway's metrics (Ray's need a cluster): migration outcomes and the
    tokens billed recorded."""

    def __init__(self) -> None:
        self.outcomes: list[str] = []
        self.tokens: dict[str, float] = {}

    def tags(self, model: str, version: str, tenant: str, pinned: bool = False) -> dict[str, str]:
        return {"model": model, "version": version, "tenant": tenant}

    def __getattr__(self, name: str) -> Any:
        outcomes, tokens = self.outcomes, self.tokens

        class Metric:
            def inc(self, value: float = 1, tags: dict[str, str] | None = None) -> None:
                if name == "migrations":
                    outcomes.append((tags or {})["outcome"])
                if name in ("prompt_tokens", "completion_tokens"):
                    tokens[name] = tokens.get(name, 0) + value

            def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
                pass

            def set(self, value: float, tags: dict[str, str] | None = None) -> None:
                pass

        return Metric()


@contextlib.asynccontextmanager
async def _gateway(*urls: str, **settings: Any) -> AsyncIterator[tuple[httpx.AsyncClient, GatewayCore]]:
    core = GatewayCore(GatewayConfig(**settings), Replicas(*urls))
    core.reconfigure(ROUTES)
    transport = httpx.ASGITransport(app=create_api(core, set_request_id_header=True))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=20) as c:
            yield c, core
    finally:
        await core.aclose()


async def _post(c: httpx.AsyncClient, kind: str, body: dict[str, Any]) -> str:
    async with c.stream("POST", PATHS[kind], json=body) as r:
        assert r.status_code == 200
        return (await r.aread()).decode()


def _died(kind: str) -> list[str]:
    """The first leg as the client of a dying engine gets it: the head, vLLM's error event, [DONE]."""
    killed = _events(DATA["killed"])
    error = next(e for e in killed if e.startswith('data: {"error"'))
    return [*_head(kind), error, "data: [DONE]"]


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("how", ["connection cut", "engine died"])
async def test_a_broken_stream_is_continued_as_if_uninterrupted(kind: str, how: str) -> None:
    rec = DATA[kind]
    first = _died(kind) if how == "engine died" else _head(kind)
    then, health = ("end", 503) if how == "engine died" else ("cut", 200)
    async with (
        _replica(first, then=then, health=health) as (a, got_a),
        _replica(_events(rec["continuation"]), then="end") as (b, got_b),
        _gateway(a, b) as (c, core),
    ):
        core.metrics = Counted()
        body = {**rec["request"], "stream": True}
        out = await _post(c, kind, body)
    assert got_a[0]["return_token_ids"] is True  # asked for, so the stream can be continued
    # the continuation: the original prompt's ids and the ids sent, the rest of the limit, and the
    # tenant's cache salt (the continued prompt's blocks stay the tenant's)
    salt = {"cache_salt": got_a[0]["cache_salt"]}
    want = {**rec["continuation_request"], **salt, "stream": True, "stream_options": got_b[0]["stream_options"]}
    assert got_b == [want]
    # the client did not ask for usage: the recording's final usage event is not expected
    plain = "\n\n".join(e for e in _events(rec["plain"]) if '"choices":[],' not in e)
    assert _summary(out) == _summary(plain)
    assert out.count("data: [DONE]") == 1 and "error" not in out
    assert core.metrics.outcomes == ["resumed"]
    assert core.in_flight["adder"] == 0  # the request was finished (billed, counted) once, at the end


async def test_chat_continues_before_tokens_whose_text_a_parser_may_hold_back() -> None:
    """The cut comes right after a token whose chunk had no text (vLLM's tool parser sends an
    empty delta for text it holds back, and for a token without text): the continuation starts
    before it, so any held-back text reaches the client, and the token is counted once."""
    rec = DATA["chat"]
    async with (
        _replica(_head("chat", rec["bare_cut"])) as (a, _),
        _replica(_events(rec["bare_continuation"]), then="end") as (b, got_b),
        _gateway(a, b) as (c, _),
    ):
        out = await _post(c, "chat", {**rec["request"], "stream": True, "stream_options": {"include_usage": True}})
    salt = {"cache_salt": got_b[0]["cache_salt"]}
    assert got_b == [{**rec["bare_request"], **salt, "stream": True, "stream_options": got_b[0]["stream_options"]}]
    assert _summary(out) == _summary(rec["plain"])
    final = [e for e in _normalized(out) if isinstance(e, dict) and not e["choices"]]
    assert final[0]["usage"]["completion_tokens"] == rec["request"]["max_tokens"]


async def test_usage_counts_the_prompt_once_and_every_token_once() -> None:
    rec = DATA["chat"]
    async with (
        _replica(_head("chat")) as (a, _),
        _replica(_events(rec["continuation"]), then="end") as (b, _),
        _gateway(a, b) as (c, _),
    ):
        body = {**rec["request"], "stream": True, "stream_options": {"include_usage": True}}
        out = await _post(c, "chat", body)
    final = [e for e in _normalized(out) if isinstance(e, dict) and not e["choices"]]
    want = [e for e in _normalized(rec["plain"]) if isinstance(e, dict) and not e["choices"]]
    assert len(final) == 1 and final[0]["usage"] == want[0]["usage"]
    assert (
        sum(1 for e in _normalized(out) if isinstance(e, dict) and e["choices"] and "role" in e["choices"][0]["delta"])
        == 1
    )


async def test_nothing_sent_yet_resends_the_original_request() -> None:
    rec = DATA["completion"]
    error = next(e for e in _events(DATA["killed"]) if e.startswith('data: {"error"'))
    async with (
        _replica([error, "data: [DONE]"], then="end", health=503) as (a, _),
        _replica(_events(rec["with_ids"]), then="end") as (b, got_b),
        _gateway(a, b) as (c, _),
    ):
        out = await _post(c, "completion", {**rec["request"], "stream": True})
    assert got_b[0]["prompt"] == rec["request"]["prompt"]
    plain = "\n\n".join(e for e in _events(rec["plain"]) if '"choices":[],' not in e)
    assert _summary(out) == _summary(plain)


async def test_an_engine_error_from_a_healthy_engine_reaches_the_client() -> None:
    error = next(e for e in _events(DATA["killed"]) if e.startswith('data: {"error"'))
    rec = DATA["completion"]
    async with _replica([*_head("completion"), error, "data: [DONE]"], then="end") as (a, _), _gateway(a) as (c, _):
        out = await _post(c, "completion", {**rec["request"], "stream": True})
    assert error in out and out.endswith("data: [DONE]\n\n")


async def test_at_most_max_migrations_then_the_error_event() -> None:
    rec = DATA["completion"]
    async with (
        _replica(_head("completion")) as (a, _),
        _replica(_events(rec["continuation"])[:3]) as (b, got_b),
        _gateway(a, b, max_migrations=1) as (c, core),
    ):
        core.metrics = Counted()
        out = await _post(c, "completion", {**rec["request"], "stream": True})
    assert len(got_b) == 1 and core.metrics.outcomes == ["resumed", "refused"]
    assert '"upstream_error"' in out and out.count("data: [DONE]") == 1


def _without_chunk_usage(events: list[str]) -> list[str]:
    """The events as vLLM sends them without ``continuous_usage_stats``: no usage on the chunks."""
    out = []
    for ev in events:
        d = json.loads(ev[6:]) if ev.startswith("data: {") else None
        if d is not None and d.get("choices"):
            d["usage"] = None
            ev = "data: " + json.dumps(d, separators=(",", ":"))
        out.append(ev)
    return out


async def test_a_stream_that_is_not_continued_bills_the_tokens_its_ids_counted() -> None:
    """The splice counts a stream's tokens from their ids, so the engine is asked for the final
    usage event only; a stream that breaks before it (and is not continued) bills that count."""
    rec = DATA["completion"]
    head = _head("completion")
    prompt = len(json.loads(head[0][6:])["choices"][0]["prompt_token_ids"])
    async with (
        _replica(_without_chunk_usage(head)) as (a, got_a),
        _replica([]) as (b, _),
        _gateway(a, b, max_migrations=1, retries=0) as (c, core),
    ):
        core.metrics = Counted()
        out = await _post(c, "completion", {**rec["request"], "stream": True})
    assert got_a[0]["stream_options"] == {"include_usage": True} and got_a[0]["return_token_ids"] is True
    assert '"upstream_error"' in out and core.metrics.outcomes == ["failed"]
    assert core.metrics.tokens == {"prompt_tokens": prompt, "completion_tokens": sum(map(_ids_of, head))}


async def test_migration_off_ends_with_the_error_event() -> None:
    rec = DATA["completion"]
    async with _replica(_head("completion")) as (a, got), _gateway(a, max_migrations=0) as (c, _):
        out = await _post(c, "completion", {**rec["request"], "stream": True})
    assert "return_token_ids" not in got[0] and '"upstream_error"' in out
    assert got[0]["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}


def test_token_ids_are_cut_out_byte_for_byte() -> None:
    """Unasked ids become null: the bytes vLLM sends without return_token_ids (chat's extra
    empty-delta chunks, which vLLM sends only with the flag, are dropped by the splice: above)."""
    stripped = null_ids(DATA["completion"]["with_ids"].encode()).decode()
    assert _summary(stripped) == _summary(DATA["completion"]["plain"])
    assert all('"token_ids":null' in e for e in _events(stripped) if '"choices":[{' in e)


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({}, None),
        ({"n": 2}, "n > 1"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"response_format": {"type": "text"}}, None),
        ({"logprobs": True}, "logprobs"),
        ({"stop": ["\n"]}, "stop strings"),
        ({"stream": False}, "not streamed"),
    ],
)
def test_what_is_not_continued(extra: dict[str, Any], why: str | None) -> None:
    body = {"model": "adder", "messages": [{"role": "user", "content": "1+1"}], "stream": True, **extra}
    assert blocker(parse_request(json.dumps(body).encode(), "chat")) == why


def test_the_continuation_keeps_sampling_and_the_limit() -> None:
    body = {
        "model": "adder",
        "messages": [{"role": "user", "content": "1+1"}],
        "stream": True,
        "temperature": 0.7,
        "seed": 5,
        "min_tokens": 8,
        "max_completion_tokens": 20,
    }
    plan = Plan.of(parse_request(json.dumps(body).encode(), "chat"), "/v1/chat/completions", "adder", 512)
    cont = json.loads(plan.body([1, 2, 3, 7, 8], 2) or b"")
    assert cont["prompt"] == [1, 2, 3, 7, 8] and cont["max_tokens"] == 18 and cont["min_tokens"] == 6
    assert cont["temperature"] == 0.7 and cont["seed"] == 5 and cont["return_token_ids"] is True
    assert plan.body([1] * 30, 20) is None  # nothing left of the limit
    unlimited = Plan.of(
        parse_request(json.dumps({**body, "max_completion_tokens": None}).encode(), "chat"), "/", "a", 64
    )
    assert json.loads(unlimited.body([1] * 10, 4) or b"")["max_tokens"] == 54  # the rest of the context
