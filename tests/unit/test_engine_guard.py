"""The engine's guard middleware as vLLM runs it: an ASGI app wrapped by ``RequireToken``."""

from __future__ import annotations

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from serving.replica.engine_guard import RequireToken


def _app() -> Starlette:
    async def ok(request: object) -> PlainTextResponse:
        return PlainTextResponse("ok")

    paths = ["/health", "/invocations", "/tokenize", "/metrics", "/v1/completions", "/ping"]
    app = Starlette(routes=[Route(p, ok, methods=["GET", "POST"]) for p in paths])
    app.add_middleware(RequireToken)  # what vLLM does with --middleware serving.replica.engine_guard.RequireToken
    return app


@pytest.mark.parametrize("path", ["/invocations", "/tokenize", "/metrics", "/v1/completions", "/ping", "/nope"])
async def test_every_route_but_health_needs_the_token(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "s3cret")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=_app()), base_url="http://e") as c:
        assert (await c.get("/health")).status_code == 200
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Basic s3cret"}):
            r = await c.post(path, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = await c.post(path, headers={"authorization": "Bearer s3cret"})
        assert r.status_code == (404 if path == "/nope" else 200)


async def test_without_a_token_in_the_environment_nothing_but_health_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=_app()), base_url="http://e") as c:
        assert (await c.get("/health")).status_code == 200
        assert (await c.post("/tokenize", headers={"authorization": "Bearer "})).status_code == 401
