from __future__ import annotations

import json

import pytest

from serving.errors import (
    AuthenticationError,
    BodyTooLarge,
    InternalError,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    RateLimited,
    Unavailable,
    UpstreamError,
    sse_error_event,
    to_response,
)


@pytest.mark.parametrize(
    ("exc", "status", "type_"),
    [
        (InvalidRequest("bad", param="messages"), 400, "invalid_request_error"),
        (BodyTooLarge("big"), 413, "invalid_request_error"),
        (AuthenticationError("who"), 401, "authentication_error"),
        (NotFound("nope", code="model_not_found"), 404, "invalid_request_error"),
        (MethodNotAllowed("no"), 405, "invalid_request_error"),
        (RateLimited("slow", headers={"retry-after": "3"}), 429, "rate_limit_exceeded"),
        (Unavailable("busy"), 503, "service_unavailable"),
        (UpstreamError("dead"), 502, "upstream_error"),
        (InternalError("oops"), 500, "server_error"),
        (KeyError("secret internals"), 500, "server_error"),
    ],
)
def test_one_error_shape(exc: Exception, status: int, type_: str) -> None:
    r = to_response(exc, "rid-1")
    body = json.loads(r.body)
    assert r.status == status
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == type_
    if status >= 500:
        assert "rid-1" in body["error"]["message"]
        assert "secret internals" not in body["error"]["message"]


def test_headers_and_param_survive() -> None:
    r = to_response(RateLimited("slow", headers={"retry-after": "3"}), "x")
    assert r.headers == {"retry-after": "3"}
    assert json.loads(to_response(InvalidRequest("b", param="n"), "x").body)["error"]["param"] == "n"


def test_sse_error_event_is_a_final_event() -> None:
    ev = sse_error_event(UpstreamError("cut"), "rid-9").decode()
    first, done = [e for e in ev.split("\n\n") if e]
    assert json.loads(first.removeprefix("data: "))["error"]["type"] == "upstream_error"
    assert done == "data: [DONE]"
