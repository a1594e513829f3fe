"""Fuzz the gateway with mutated OpenAI bodies: whatever a client sends, never a 5xx.

A seeded, self-contained fuzzer (no extra dependency): it starts from valid chat and completion
bodies and applies random mutations (drop or retype fields, out-of-range numbers, odd unicode,
deep nesting, wrong containers, truncated JSON), then checks each answer is 2xx/4xx with the
OpenAI error shape. Generation is capped (max_tokens <= 8) so valid bodies stay cheap.
"""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
import pytest

from tests.conftest import Stack

pytestmark = pytest.mark.integration

VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2**63,
    -(2**63),
    1e308,
    -1e-308,
    0.5,
    "",
    "x",
    "🦀" * 3,
    "\u0000",
    "a" * 300,
    [],
    [1, "a"],
    {},
    {"a": {"b": [None]}},
    "adder",
    "adder@v9",
]
FIELDS = [
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "min_tokens",
    "logprobs",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "user",
    "response_format",
    "tools",
    "tool_choice",
]


def _base(rng: random.Random, chat: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": rng.choice(["adder", "subtractor", "default"]), "max_tokens": rng.randint(1, 8)}
    if chat:
        body["messages"] = [{"role": rng.choice(["user", "system", "assistant"]), "content": "12+30="}]
    else:
        body["prompt"] = "12+30="
    return body


def _mutate(rng: random.Random, body: dict[str, Any]) -> dict[str, Any]:
    for _ in range(rng.randint(1, 4)):
        op = rng.random()
        field = rng.choice(FIELDS)
        if op < 0.3:
            body.pop(field, None)
        elif op < 0.7:
            body[field] = rng.choice(VALUES)
        elif op < 0.85 and isinstance(body.get("messages"), list) and body["messages"]:
            msg = body["messages"][0]
            if isinstance(msg, dict):
                msg[rng.choice(["role", "content", "name", "tool_calls"])] = rng.choice(VALUES)
        else:
            body[field] = [rng.choice(VALUES) for _ in range(rng.randint(0, 3))]
    if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool) and body["max_tokens"] > 8:
        body["max_tokens"] = 8
    body.pop("max_completion_tokens", None) if isinstance(body.get("max_completion_tokens"), int) else None
    if isinstance(body.get("n"), int) and not isinstance(body["n"], bool) and body["n"] > 2:
        body["n"] = 2
    return body


def _raw(rng: random.Random, body: dict[str, Any]) -> bytes:
    text = json.dumps(body)
    r = rng.random()
    if r < 0.05:
        return text[: rng.randint(0, len(text))].encode()
    if r < 0.08:
        return b"\xff\xfe" + text.encode()
    if r < 0.10:
        return ("[" * 2000 + "]" * 2000).encode()
    return text.encode()


def test_fuzzed_bodies_never_get_a_5xx(stack: Stack) -> None:
    rng = random.Random(20261130)
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=stack.url, headers=stack.headers(), timeout=120) as c:
        for i in range(300):
            chat = i % 2 == 0
            body = _mutate(rng, _base(rng, chat))
            path = "/v1/chat/completions" if chat else "/v1/completions"
            r = c.post(path, content=_raw(rng, body), headers={"content-type": "application/json"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, (body, r.status_code, r.text[:500])
            if r.status_code >= 400:
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
                assert "Traceback" not in r.text
    assert statuses.get(200, 0) > 10 and sum(v for k, v in statuses.items() if k >= 400) > 100, statuses
