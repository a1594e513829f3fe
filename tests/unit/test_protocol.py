from __future__ import annotations

import json

import pytest

from serving.errors import InvalidRequest
from serving.protocol import normalize_upstream_error, parse_request

MSG = [{"role": "user", "content": "1+1="}]


def _p(body: object, kind: str = "chat") -> object:
    return parse_request(json.dumps(body).encode(), kind)  # type: ignore[arg-type]


def test_valid_chat_and_completion() -> None:
    p = _p({"model": "a", "messages": MSG, "stream": True, "stream_options": {"include_usage": True}})
    assert p.model == "a" and p.stream and p.include_usage and p.kind == "chat"
    c = _p({"model": "a", "prompt": "x", "max_tokens": 3}, "completion")
    assert c.prompt_text() == "x" and not c.stream


@pytest.mark.parametrize(
    ("body", "kind", "param"),
    [
        ({"model": "a"}, "chat", "messages"),
        ({"model": "a", "messages": []}, "chat", "messages"),
        ({"model": "a", "messages": [{"role": "wizard", "content": "x"}]}, "chat", "messages[0].role"),
        ({"model": "a", "messages": [{"role": "user", "content": 5}]}, "chat", "messages[0].content"),
        ({"model": "a", "messages": ["hi"]}, "chat", "messages[0]"),
        ({"model": 3, "messages": MSG}, "chat", "model"),
        ({"model": "a", "messages": MSG, "max_tokens": 0}, "chat", "max_tokens"),
        ({"model": "a", "messages": MSG, "max_tokens": True}, "chat", "max_tokens"),
        ({"model": "a", "messages": MSG, "n": 1.5}, "chat", "n"),
        ({"model": "a", "messages": MSG, "top_p": "x"}, "chat", "top_p"),
        ({"model": "a", "messages": MSG, "stream": 1}, "chat", "stream"),
        ({"model": "a"}, "completion", "prompt"),
        ({"model": "a", "prompt": ""}, "completion", "prompt"),
        ({"model": "a", "prompt": {"x": 1}}, "completion", "prompt"),
    ],
)
def test_invalid_bodies(body: object, kind: str, param: str) -> None:
    with pytest.raises(InvalidRequest) as exc:
        _p(body, kind)
    assert exc.value.param == param


@pytest.mark.parametrize("raw", [b"{", b"[]", b"null", b"\xff\xfe"])
def test_not_json_objects(raw: bytes) -> None:
    with pytest.raises(InvalidRequest):
        parse_request(raw, "chat")


def test_model_rewrite_keeps_bytes_when_unchanged() -> None:
    raw = b'{"model": "adder", "prompt": "1"}'
    p = parse_request(raw, "completion")
    assert p.with_model("adder") is raw
    assert json.loads(p.with_model("other"))["model"] == "other"


def test_upstream_errors_are_normalised() -> None:
    vllm = b'{"error":{"message":"too long","type":"BadRequestError","param":"body.max_tokens","code":400}}'
    err = json.loads(normalize_upstream_error(400, vllm))["error"]
    assert err == {"message": "too long", "type": "invalid_request_error", "param": "max_tokens", "code": None}
    assert json.loads(normalize_upstream_error(400, b"plain"))["error"]["message"] == "plain"
