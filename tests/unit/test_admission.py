"""Admission of generating and embedding requests: what a request reserves against its tenant's
TPM (prompt and completion, serving.gateway.admission.reserve), the bound that keeps concurrent
requests within a limit, and shedding, which comes before the quota and so costs no request."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from aiohttp import web

from loadtests.relay import OneReplica
from serving.gateway.admission.auth import hash_key
from serving.gateway.admission.reserve import SPECIAL_TOKENS, TEMPLATE_TOKENS, reservation
from serving.gateway.agent_protocol import parse_agent_request
from serving.gateway.protocol import parse_request
from tests.support.gateway import quota_gateway
from tests.support.loopback import http_replica

KEY = "sk-t"
AUTH = {"authorization": f"Bearer {KEY}"}


def _reserve(body: dict[str, Any], kind: Any, context: int = 4096) -> tuple[int, int]:
    return parse_request(json.dumps(body).encode(), kind).reserve_tokens(context)


def _chat_bound(messages: list[dict[str, Any]]) -> int:
    return len(json.dumps([messages], separators=(",", ":"), ensure_ascii=False).encode()) + TEMPLATE_TOKENS


def test_completions_reserve_max_tokens_only_16_when_unset_n_per_prompt() -> None:
    """vLLM's CompletionRequest ignores max_completion_tokens and generates up to max_tokens
    (16 when absent or null), n completions for each prompt of a list."""
    body = {"prompt": "count to a thousand:", "max_completion_tokens": 1, "max_tokens": 2000}
    assert _reserve(body, "completion") == (20 + SPECIAL_TOKENS, 2000)
    assert _reserve({"prompt": "1"}, "completion") == (1 + SPECIAL_TOKENS, 16)
    assert _reserve({"prompt": "1", "max_tokens": None, "max_completion_tokens": 900}, "completion")[1] == 16
    assert _reserve({"prompt": ["a", "bb"], "max_tokens": 5, "n": 3}, "completion") == (3 + 2 * SPECIAL_TOKENS, 30)
    # token ids are their own count; a prompt longer than the context is refused, so never more
    assert _reserve({"prompt": [[1, 2, 3], [4]], "max_tokens": 2}, "completion") == (4, 4)
    assert _reserve({"prompt": "x" * 5000, "max_tokens": 6}, "completion", context=64) == (58, 6)


def test_chat_reserves_its_prompts_bytes_and_keeps_each_sequence_within_the_context() -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "é" * 10 + "1+1="}]
    assert _reserve({"messages": messages, "max_completion_tokens": 7, "max_tokens": 99}, "chat") == (
        _chat_bound(messages),
        7,
    )
    assert _reserve({"messages": messages, "max_tokens": 7, "n": 2}, "chat") == (_chat_bound(messages), 14)
    # tools are rendered into the prompt too
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    assert _reserve({"messages": messages, "tools": tools, "max_tokens": 7}, "chat")[0] > _chat_bound(messages)
    # no limit: the context length, all of it, as before the prompt was counted
    assert _reserve({"messages": messages}, "chat", context=256) == (0, 256)
    # an image's tokens are the processor's: the context length
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]
    assert _reserve({"messages": image, "max_tokens": 10}, "chat", context=2048) == (2038, 10)


@pytest.mark.parametrize(
    ("inp", "prompt"),
    [("a cat sits", 10 + SPECIAL_TOKENS), (["a", "b"], 2 + 2 * SPECIAL_TOKENS), ([1, 2, 3], 3), ([[1, 2], [3]], 3)],
)
def test_embeddings_reserve_their_input(inp: object, prompt: int) -> None:
    assert _reserve({"model": "e", "input": inp}, "embedding") == (prompt, 0)
    assert _reserve({"model": "e", "input": "word " * 400}, "embedding", context=256) == (256, 0)


def test_messages_and_responses_reserve_their_input_as_chat_does() -> None:
    messages = [{"role": "user", "content": "1+1="}]
    req = parse_agent_request(json.dumps({"model": "m", "max_tokens": 8, "messages": messages}).encode(), "messages")
    assert req.reserve_tokens(512) == (_chat_bound(messages), 8)
    req = parse_agent_request(
        b'{"model":"m","input":"1+1=","instructions":"be brief","max_output_tokens":8}', "responses"
    )
    assert req.reserve_tokens(512) == (len(b'["be brief","1+1="]') + TEMPLATE_TOKENS, 8)


def test_no_request_within_its_bounds_uses_more_than_it_reserves() -> None:
    """Any prompt up to its bound and n completions up to the limit, every sequence within the
    context (vLLM's rule), use at most the reservation: the worst is the largest prompt that
    still leaves each completion its whole limit."""
    context = 64
    for bound in (1, 20, 63, 64, 200):
        for limit in (1, 16, 40, 64, 100):
            for n in (1, 3):
                reserved = sum(reservation([bound], limit, n, context))
                for p in range(1, min(bound, context) + 1):
                    assert p + n * min(limit, context - p) <= reserved, (bound, limit, n, p)


STACK: dict[str, Any] = {
    "auth": {"mode": "keys", "tenants": [{"name": "t", "key_hashes": [hash_key(KEY)], "tpm": 1000}]},
    "models": [{"name": "m", "engine": {"max_model_len": 2048}, "versions": [{"version": "v1"}]}],
}


async def test_concurrent_long_prompts_cannot_overshoot_tpm_by_more_than_one_reservation() -> None:
    """TPM 1000: ten concurrent chats, each a 900-token prompt with max_tokens 10. Reserving
    completions only let all ten in (9100 tokens); the prompt's share admits one, which is billed
    what it used and gives the rest of its reservation back."""

    async def handler(request: web.Request) -> web.Response:
        await asyncio.sleep(0.3)  # the engine works on it
        usage = {"prompt_tokens": 900, "completion_tokens": 10, "total_tokens": 910}
        message = {"role": "assistant", "content": "ok"}
        choices = [{"index": 0, "message": message, "finish_reason": "stop"}]
        return web.json_response({"id": "c", "object": "chat.completion", "choices": choices, "usage": usage})

    body = {"model": "m", "messages": [{"role": "user", "content": "x " * 900}], "max_tokens": 10}
    reserved = sum(parse_request(json.dumps(body).encode(), "chat").reserve_tokens(2048))
    async with (
        http_replica(handler, path="/v1/chat/completions") as url,
        quota_gateway(OneReplica(url), STACK) as (c, _, actor),
    ):
        rs = await asyncio.gather(*(c.post("/v1/chat/completions", json=body, headers=AUTH) for _ in range(10)))
        assert [r.status_code for r in rs].count(200) == 1 and {r.status_code for r in rs} == {200, 429}
        refused = next(r for r in rs if r.status_code == 429)
        assert refused.json()["error"]["code"] == "rate_limit_tokens"
        used = actor.counter._windows["t"][2]
        assert used == 910 < 1000 + reserved and actor.counter.reserved("t", time.time()) == 0
        # the next request sees what was used, not what was reserved
        assert actor.admit("t", None, 1000, 60).remaining_tokens == 1000 - 910


async def test_a_shed_request_costs_no_rpm() -> None:
    """A low-priority tenant (rpm 3) shed with 503 while the model is busy obeys Retry-After: once
    the model frees up its requests are admitted, none of its RPM spent on the shed ones."""
    tenant = {"name": "low", "key_hashes": [hash_key(KEY)], "rpm": 3, "priority": 2}
    stack = {"auth": {"mode": "keys", "tenants": [tenant]}, "models": [{"name": "m", "versions": [{"version": "v1"}]}]}

    async def handler(request: web.Request) -> web.Response:
        return web.json_response({"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "2"}]})

    body = {"model": "m", "prompt": "1+1=", "max_tokens": 4}
    async with http_replica(handler) as url, quota_gateway(OneReplica(url), stack) as (c, core, actor):
        core.in_flight["m"] = core.routes.models["m"].shed_low_priority_at  # busy with other tenants' requests
        shed = [await c.post("/v1/completions", json=body, headers=AUTH) for _ in range(3)]
        for r in shed:
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            error = r.json()["error"]
            assert error["type"] == "service_unavailable" and "low-priority requests are shed" in error["message"]
        core.in_flight["m"] = 0
        r = await c.post("/v1/completions", json=body, headers=AUTH)
        assert r.status_code == 200 and r.headers["x-ratelimit-remaining-requests"] == "2", r.text
