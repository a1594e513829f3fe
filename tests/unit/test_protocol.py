from __future__ import annotations

import json

import pytest

from serving.errors import InvalidRequest
from serving.gateway.answers import StreamTap, normalize_upstream_error, usage_of
from serving.gateway.protocol import parse_request

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


@pytest.mark.parametrize("raw", [b"{", b"[]", b"null", b"\xff\xfe", b"[" * 5000 + b"]" * 5000])
def test_not_json_objects(raw: bytes) -> None:
    with pytest.raises(InvalidRequest):
        parse_request(raw, "chat")


def test_model_rewrite_keeps_bytes_when_unchanged() -> None:
    raw = b'{"model": "adder", "prompt": "1"}'
    p = parse_request(raw, "completion")
    assert p.upstream_body("adder") is raw
    assert json.loads(p.upstream_body("other"))["model"] == "other"


def test_streams_without_token_ids_ask_for_usage_on_every_chunk_upstream() -> None:
    every = {"include_usage": True, "continuous_usage_stats": True}
    p = parse_request(b'{"model": "a", "prompt": "1", "stream": true}', "completion")
    assert json.loads(p.upstream_body("a"))["stream_options"] == every
    q = parse_request(
        b'{"model": "a", "prompt": "1", "stream": true, "stream_options": {"include_usage": true}}', "completion"
    )
    assert json.loads(q.upstream_body("a"))["stream_options"] == every
    raw = b'{"model": "a", "prompt": "1", "stream": true, "stream_options": ' + json.dumps(every).encode() + b"}"
    r = parse_request(raw, "completion")
    assert r.continuous_usage and r.upstream_body("a") is r.raw


def test_a_stream_counted_from_its_token_ids_asks_only_for_the_final_usage_event() -> None:
    p = parse_request(b'{"model": "a", "prompt": "1", "stream": true}', "completion")
    body = json.loads(p.upstream_body("a", token_ids=True))
    assert body["stream_options"] == {"include_usage": True} and body["return_token_ids"] is True
    every = {"include_usage": True, "continuous_usage_stats": True}
    q = parse_request(json.dumps({"prompt": "1", "stream": True, "stream_options": every}).encode(), "completion")
    assert json.loads(q.upstream_body("a", token_ids=True))["stream_options"] == every


def test_reservation_is_the_prompt_and_n_times_the_token_limit() -> None:
    """(prompt, completion) reserved: the rule's cases are in tests/unit/test_admission.py."""
    assert parse_request(b'{"prompt": "1", "max_tokens": 5, "n": 3}', "completion").reserve_tokens(64) == (5, 15)
    assert parse_request(b'{"prompt": "1"}', "completion").reserve_tokens(64) == (5, 16)  # vLLM's default
    chat = parse_request(b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 7}', "chat")
    assert chat.reserve_tokens(64) == (57, 7)  # the prompt's bound (93) is capped: each sequence fits in 64


SSE = (
    b'data: {"choices":[{"delta":{"content":"4"}}]}\n\n'
    b'data: {"choices":[{"delta":{"content":"2"}}]}\n\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}}\n\n'
    b"data: [DONE]\n\n"
)


@pytest.mark.parametrize("size", [1, 3, 7, 50, len(SSE)])
@pytest.mark.parametrize("strip", [True, False])
def test_stream_tap_finds_usage_across_any_chunking(size: int, strip: bool) -> None:
    tap = StreamTap(strip_usage=strip)
    out = b"".join(tap.feed(SSE[i : i + size]) for i in range(0, len(SSE), size)) + tap.flush()
    assert tap.usage == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    assert (b'"usage"' in out) is not strip
    assert out.endswith(b"data: [DONE]\n\n") and out.count(b"\n\n") == (3 if strip else 4)


def _chunk(i: int, text: str, done: int, usage: bool = True) -> bytes:
    u = f',"usage":{{"prompt_tokens":5,"completion_tokens":{done},"total_tokens":{5 + done}}}' if usage else ""
    return f'data: {{"id":"c","choices":[{{"index":{i},"text":"{text}","logprobs":null}}]{u}}}\n\n'.encode()


FINAL = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":4,"total_tokens":9}}\n\n'
CONTINUOUS = _chunk(0, "4", 1) + _chunk(1, "4", 1) + _chunk(0, "2", 2) + _chunk(1, "2", 2) + FINAL + b"data: [DONE]\n\n"


@pytest.mark.parametrize("size", [1, 9, 64, len(CONTINUOUS)])
def test_stream_tap_strips_what_the_client_did_not_ask_for(size: int) -> None:
    def run(tap: StreamTap) -> bytes:
        parts = [CONTINUOUS[i : i + size] for i in range(0, len(CONTINUOUS), size)]
        return b"".join(tap.feed(p) for p in parts) + tap.flush()

    bare = _chunk(0, "4", 0, False) + _chunk(1, "4", 0, False) + _chunk(0, "2", 0, False) + _chunk(1, "2", 0, False)
    nothing, final, every = StreamTap(True), StreamTap(False), StreamTap(False, keep_chunk_usage=True)
    assert run(nothing) == bare + b"data: [DONE]\n\n"
    assert run(final) == bare + FINAL + b"data: [DONE]\n\n"
    assert run(every) == CONTINUOUS
    for tap in (nothing, final, every):
        assert tap.usage == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}


def test_stream_tap_knows_the_usage_of_a_stream_that_never_ends() -> None:
    tap = StreamTap(True)
    out = tap.feed(_chunk(0, "4", 1) + _chunk(1, "4", 1) + _chunk(0, "2", 2))  # n=2, cut before the end
    assert b'"usage"' not in out
    assert tap.usage == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


def test_usage_of_plain_body() -> None:
    assert usage_of(b'{"usage": {"total_tokens": 3}}') == {"total_tokens": 3}
    assert usage_of(b"not json") is None


def test_upstream_errors_are_normalised() -> None:
    vllm = b'{"error":{"message":"too long","type":"BadRequestError","param":"body.max_tokens","code":400}}'
    err = json.loads(normalize_upstream_error(400, vllm))["error"]
    assert err == {"message": "too long", "type": "invalid_request_error", "param": "max_tokens", "code": None}
    assert json.loads(normalize_upstream_error(400, b"plain"))["error"]["message"] == "plain"
