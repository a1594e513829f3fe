"""The engines' prefix cache is kept apart per tenant: the real gateway app and relay over a
replica on loopback that records what it is sent. Under ``prefix_cache_scope: tenant`` (the
default) every generating or embedding request reaches vLLM with a ``cache_salt`` of its tenant (and of the
client's own salt), which a client cannot choose; under ``shared`` the body goes as sent."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from aiohttp import web

from loadtests.relay import OneReplica
from serving.config import GatewayConfig, parse_config
from serving.control.serve_config import routing_user_config
from serving.gateway.admission.auth import hash_key, tenant_cache_salt
from serving.gateway.api import create_api
from serving.gateway.core import GatewayCore
from tests.support.loopback import http_replica

KEYS = {"t": "sk-t", "u": "sk-u"}
STACK = {
    "auth": {
        "mode": "keys",
        "tenants": [{"name": n, "key_hashes": [hash_key(k)], "models": ["m", "e"]} for n, k in KEYS.items()],
    },
    "models": [
        {"name": "m", "engine": {"max_model_len": 64}, "versions": [{"version": "v1"}]},
        {"name": "e", "engine": {"runner": "pooling", "max_model_len": 64}, "versions": [{"version": "v1"}]},
    ],
}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "1+1="}], "max_tokens": 2}
REQUESTS = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"model": "m", "prompt": "1+1=", "max_tokens": 2},
    "/v1/responses": {"model": "m", "input": "1+1=", "max_output_tokens": 2, "store": False},  # no store actor
    "/v1/messages": {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "1+1="}]},
    "/v1/embeddings": {"model": "e", "input": "1+1="},  # vLLM caches a causal embedding model's blocks too
}
ANSWERS = {
    "/v1/chat/completions": {"id": "c", "object": "chat.completion", "choices": [], "usage": {"prompt_tokens": 1}},
    "/v1/completions": {"id": "c", "object": "text_completion", "choices": [], "usage": {"prompt_tokens": 1}},
    "/v1/responses": {"id": "resp_1", "object": "response", "status": "completed", "output": [], "usage": {}},
    "/v1/messages": {"id": "msg_1", "type": "message", "role": "assistant", "content": [], "usage": {}},
    "/v1/embeddings": {"object": "list", "data": [], "usage": {"prompt_tokens": 1}},
    "/tokenize": {"tokens": [1], "count": 1, "max_model_len": 64},
}


@contextlib.asynccontextmanager
async def _gateway(**settings: Any) -> AsyncIterator[tuple[httpx.AsyncClient, list[dict[str, Any]]]]:
    seen: list[dict[str, Any]] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response(ANSWERS[request.path])

    async with http_replica(handler, path="/{tail:.*}") as url:
        core = GatewayCore(GatewayConfig(**settings), OneReplica(url))
        core.reconfigure(routing_user_config(parse_config(STACK)))
        transport = httpx.ASGITransport(app=create_api(core))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=20) as c:
                yield c, seen
        finally:
            await core.aclose()


def _auth(tenant: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[tenant]}"}


@pytest.mark.parametrize("path", list(REQUESTS))
async def test_each_tenants_generating_requests_carry_a_salt_of_their_own(path: str) -> None:
    async with _gateway() as (c, seen):
        for tenant in ("t", "u", "t"):
            r = await c.post(path, json=REQUESTS[path], headers=_auth(tenant))
            assert r.status_code == 200, r.text
    salts = [b["cache_salt"] for b in seen]
    assert salts == [tenant_cache_salt("t"), tenant_cache_salt("u"), tenant_cache_salt("t")]
    assert salts[0] != salts[1]


async def test_a_clients_salt_is_kept_apart_within_its_tenant_and_cannot_reach_anothers() -> None:
    async with _gateway() as (c, seen):
        own = tenant_cache_salt("u", "alice")
        for tenant, salt in (("t", "alice"), ("u", "alice"), ("t", tenant_cache_salt("u"))):
            r = await c.post("/v1/chat/completions", json={**CHAT, "cache_salt": salt}, headers=_auth(tenant))
            assert r.status_code == 200, r.text
        for bad in (7, "", ["x"]):
            r = await c.post("/v1/chat/completions", json={**CHAT, "cache_salt": bad}, headers=_auth("t"))
            assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
    salts = [b["cache_salt"] for b in seen]
    assert salts == [tenant_cache_salt("t", "alice"), own, tenant_cache_salt("t", tenant_cache_salt("u"))]
    assert len(set(salts) | {tenant_cache_salt("u")}) == 4  # sending another tenant's salt reaches nothing of its


async def test_a_tokenize_request_and_a_shared_scope_are_sent_as_they_came() -> None:
    async with _gateway() as (c, seen):
        r = await c.post("/tokenize", json={"model": "m", "prompt": "1"}, headers=_auth("t"))
        assert r.status_code == 200, r.text
    assert all("cache_salt" not in b for b in seen)
    async with _gateway(prefix_cache_scope="shared") as (c, seen):
        for tenant in ("t", "u"):
            r = await c.post("/v1/chat/completions", json=CHAT, headers=_auth(tenant))
            assert r.status_code == 200
        r = await c.post("/v1/chat/completions", json={**CHAT, "cache_salt": "mine"}, headers=_auth("t"))
        assert r.status_code == 200
    assert [b.get("cache_salt") for b in seen] == [None, None, "mine"]
    assert seen[0]["messages"] == CHAT["messages"]
