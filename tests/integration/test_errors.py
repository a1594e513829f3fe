"""Every client mistake gets its status and the OpenAI error shape; the stack keeps serving."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import Stack

pytestmark = pytest.mark.integration

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "1+1="}]

CASES = [
    # (name, method, path, body (bytes or json), status, param)
    ("unknown model", "POST", CHAT, {"model": "nope", "messages": MSG}, 404, "model"),
    ("unknown version", "POST", CHAT, {"model": "adder@v9", "messages": MSG}, 404, "model"),
    ("malformed json", "POST", CHAT, b'{"model": "adder", "messages": [', 400, None),
    ("json not an object", "POST", CHAT, b"[1, 2]", 400, None),
    ("missing messages", "POST", CHAT, {"model": "adder"}, 400, "messages"),
    ("empty messages", "POST", CHAT, {"model": "adder", "messages": []}, 400, "messages"),
    ("messages not a list", "POST", CHAT, {"model": "adder", "messages": "hi"}, 400, "messages"),
    ("model not a string", "POST", CHAT, {"model": 7, "messages": MSG}, 400, "model"),
    ("max_tokens wrong type", "POST", CHAT, {"model": "adder", "messages": MSG, "max_tokens": "x"}, 400, "max_tokens"),
    (
        "temperature wrong type",
        "POST",
        CHAT,
        {"model": "adder", "messages": MSG, "temperature": "hot"},
        400,
        "temperature",
    ),
    ("stream wrong type", "POST", CHAT, {"model": "adder", "messages": MSG, "stream": "yes"}, 400, "stream"),
    ("max_tokens zero", "POST", CHAT, {"model": "adder", "messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    (
        "max_tokens negative",
        "POST",
        "/v1/completions",
        {"model": "adder", "prompt": "1", "max_tokens": -5},
        400,
        "max_tokens",
    ),
    (
        "max_tokens beyond context",
        "POST",
        CHAT,
        {"model": "adder", "messages": MSG, "max_tokens": 100000},
        400,
        "max_tokens",
    ),
    (
        "prompt longer than context",
        "POST",
        "/v1/completions",
        {"model": "adder", "prompt": "1+2 " * 600, "max_tokens": 2},
        400,
        None,
    ),
    (
        "chat prompt longer than context",
        "POST",
        CHAT,
        {"model": "subtractor", "messages": [{"role": "user", "content": "9-8 " * 600}]},
        400,
        None,
    ),
    (
        "unsupported role",
        "POST",
        CHAT,
        {"model": "adder", "messages": [{"role": "wizard", "content": "hi"}]},
        400,
        "messages[0].role",
    ),
    ("missing prompt", "POST", "/v1/completions", {"model": "adder"}, 400, "prompt"),
    (
        "negative temperature (vLLM's check)",
        "POST",
        CHAT,
        {"model": "adder", "messages": MSG, "temperature": -1},
        400,
        "temperature",
    ),
    ("n zero", "POST", CHAT, {"model": "adder", "messages": MSG, "n": 0}, 400, "n"),
    (
        "body over the size limit",
        "POST",
        CHAT,
        {"model": "adder", "messages": [{"role": "user", "content": "x" * 70000}]},
        413,
        None,
    ),
    ("wrong method", "GET", CHAT, None, 405, None),
    ("wrong method on models", "DELETE", "/v1/models", None, 405, None),
    ("unknown path", "GET", "/v2/nothing", None, 404, None),
    ("unknown model card", "GET", "/v1/models/nope", None, 404, "model"),
]


@pytest.mark.parametrize(("name", "method", "path", "body", "status", "param"), CASES, ids=[c[0] for c in CASES])
def test_client_error(
    stack: Stack, name: str, method: str, path: str, body: object, status: int, param: str | None
) -> None:
    kwargs: dict[str, object] = {"headers": stack.headers()}
    if isinstance(body, bytes):
        kwargs["content"] = body
        kwargs["headers"] = {**stack.headers(), "content-type": "application/json"}
    elif body is not None:
        kwargs["json"] = body
    r = httpx.request(method, stack.url + path, timeout=60, **kwargs)  # type: ignore[arg-type]
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and isinstance(err["message"], str)
    assert "Traceback" not in r.text
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param
    assert r.headers.get("x-request-id")


def test_still_serving_after_errors(stack: Stack) -> None:
    r = httpx.post(
        f"{stack.url}/v1/completions",
        json={"model": "adder", "prompt": "12+30=", "max_tokens": 4, "temperature": 0},
        headers=stack.headers(),
        timeout=60,
    )
    # the model's sum (the trained model's arithmetic is scored in test_chat_surface.py)
    assert r.status_code == 200 and r.json()["choices"][0]["text"].strip().isdigit(), r.text


def test_an_engine_error_reaches_the_client_once_and_the_replica_stays(stack: Stack) -> None:
    """vLLM itself refuses min_tokens above max_tokens (the gateway does not check it): the client
    gets vLLM's 400, in OpenAI's shape, after one attempt; the replica is not sidelined."""
    body = {"model": "adder", "messages": MSG, "max_tokens": 2, "min_tokens": 10}
    headers = {**stack.headers(), "x-request-id": "itest-engine-error"}
    r = httpx.post(f"{stack.url}{CHAT}", json=body, headers=headers, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "min_tokens" in err["message"], err
    assert r.headers["x-upstream-attempts"] == "1"
    gateway, replica = r.headers["x-gateway-replica"], r.headers["x-replica"]
    # Within the 5 s a failed replica would be skipped, the same gateway replica still picks it.
    ok = {"model": "adder", "prompt": "1+2=", "max_tokens": 2}
    seen = set()
    for _ in range(40):
        s = httpx.post(f"{stack.url}/v1/completions", json=ok, headers=stack.headers(), timeout=60)
        assert s.status_code == 200
        if s.headers["x-gateway-replica"] == gateway:
            seen.add(s.headers["x-replica"])
        if replica in seen:
            break
    assert replica in seen
