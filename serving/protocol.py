"""OpenAI wire checks the gateway owns. Imports nothing from ray, vllm or torch.

The gateway parses a request body once, checks what it routes on and what the engine would
mishandle (vLLM accepts unknown chat roles, for example), and forwards the original bytes untouched
unless it must rewrite the model name. Everything else (sampling parameters, context length)
is validated by vLLM itself, whose 4xx answers are normalised by :func:`normalize_upstream_error`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from serving.errors import InvalidRequest, error_body

__all__ = ["ParsedRequest", "StreamTap", "normalize_upstream_error", "parse_request", "usage_of"]

Kind = Literal["chat", "completion"]
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
_INT_FIELDS = ("max_tokens", "max_completion_tokens", "n", "seed", "top_logprobs")
_NUM_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty")


@dataclass(frozen=True)
class ParsedRequest:
    kind: Kind
    body: dict[str, Any]
    raw: bytes
    model: str | None
    stream: bool
    include_usage: bool

    def prompt_text(self, limit: int = 4096) -> str:
        """Leading prompt text, only for prefix-affinity routing (never logged)."""
        if self.kind == "completion":
            p = self.body.get("prompt")
            return p[:limit] if isinstance(p, str) else ""
        parts: list[str] = []
        for m in self.body.get("messages", []):
            c = m.get("content")
            parts.append(c if isinstance(c, str) else "")
            if sum(map(len, parts)) >= limit:
                break
        return "".join(parts)[:limit]

    def upstream_body(self, name: str) -> bytes:
        """The body to forward: ``model`` set to the engine's served name and, for streams, usage
        always requested (the gateway needs it for quotas and metrics; :class:`StreamTap` strips
        it again if the client did not ask). Unchanged bodies are forwarded as the same bytes."""
        force_usage = self.stream and not self.include_usage
        if self.body.get("model") == name and not force_usage:
            return self.raw
        body = {**self.body, "model": name}
        if force_usage:
            body["stream_options"] = {**(self.body.get("stream_options") or {}), "include_usage": True}
        return msgspec.json.encode(body)


class StreamTap:
    """Event-aligned pass-through of an SSE byte stream that picks out the usage event.

    Bytes are released at event boundaries (``\n\n``) only; events are parsed only when they
    carry ``"usage":{`` (the final usage chunk), so per-token cost is a couple of byte searches.
    """

    __slots__ = ("_buf", "strip_usage", "usage")

    def __init__(self, strip_usage: bool) -> None:
        self._buf = b""
        self.strip_usage = strip_usage
        self.usage: dict[str, Any] | None = None

    def feed(self, chunk: bytes) -> bytes:
        data = self._buf + chunk if self._buf else chunk
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self._buf = data
            return b""
        out, self._buf = data[: cut + 2], data[cut + 2 :]
        return self._take_usage(out) if b'"usage":{' in out else out

    def flush(self) -> bytes:
        out, self._buf = self._buf, b""
        return out

    def _take_usage(self, out: bytes) -> bytes:
        kept: list[bytes] = []
        for ev in out.split(b"\n\n"):
            if ev.startswith(b"data: {") and b'"usage":{' in ev:
                try:
                    obj = msgspec.json.decode(ev[6:])
                except msgspec.DecodeError:
                    kept.append(ev)
                    continue
                if isinstance(obj.get("usage"), dict):
                    self.usage = obj["usage"]
                if self.strip_usage and not obj.get("choices"):
                    continue
            kept.append(ev)
        return b"\n\n".join(kept)


def usage_of(body: bytes) -> dict[str, Any] | None:
    """The ``usage`` object of a non-streamed response body, if any."""
    try:
        u = msgspec.json.decode(body).get("usage")
    except (msgspec.DecodeError, AttributeError):
        return None
    return u if isinstance(u, dict) else None


def _type_name(v: object) -> str:
    return {
        str: "string",
        bool: "boolean",
        int: "integer",
        float: "number",
        list: "array",
        dict: "object",
        type(None): "null",
    }.get(type(v), type(v).__name__)


def _check_types(body: dict[str, Any]) -> None:
    for key in _INT_FIELDS:
        v = body.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise InvalidRequest(f"'{key}' must be an integer, not {_type_name(v)}", param=key)
    for key in ("max_tokens", "max_completion_tokens", "n"):
        v = body.get(key)
        if v is not None and v < 1:
            raise InvalidRequest(f"'{key}' must be at least 1, got {v}", param=key)
    for key in _NUM_FIELDS:
        v = body.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise InvalidRequest(f"'{key}' must be a number, not {_type_name(v)}", param=key)
    for key in ("stream",):
        v = body.get(key)
        if v is not None and not isinstance(v, bool):
            raise InvalidRequest(f"'{key}' must be a boolean, not {_type_name(v)}", param=key)
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise InvalidRequest("'stream_options' must be an object", param="stream_options")


def _check_messages(messages: object) -> None:
    if messages is None:
        raise InvalidRequest("'messages' is a required property", param="messages")
    if not isinstance(messages, list):
        raise InvalidRequest(f"'messages' must be an array, not {_type_name(messages)}", param="messages")
    if not messages:
        raise InvalidRequest("'messages' must contain at least one message", param="messages")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InvalidRequest(f"'{where}' must be an object", param=where)
        role = m.get("role")
        if role not in ROLES:
            raise InvalidRequest(f"'{where}.role' must be one of {sorted(ROLES)}, got {role!r}", param=f"{where}.role")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise InvalidRequest(f"'{where}.content' must be a string or an array of parts", param=f"{where}.content")


def _check_prompt(prompt: object) -> None:
    if prompt is None:
        raise InvalidRequest("'prompt' is a required property", param="prompt")
    ok = isinstance(prompt, str) or (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in prompt)
    )
    if not ok or prompt == "":
        raise InvalidRequest("'prompt' must be a non-empty string or array", param="prompt")


def parse_request(raw: bytes, kind: Kind) -> ParsedRequest:
    """Parse and check a chat or completion request body; raise :class:`InvalidRequest`."""
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}") from None
    except RecursionError:  # found by tests/integration/test_fuzz.py: "[[[[...]]]]" was a 500
        raise InvalidRequest("The request body is nested too deeply.") from None
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest(f"'model' must be a string, not {_type_name(model)}", param="model")
    _check_types(body)
    if kind == "chat":
        _check_messages(body.get("messages"))
    else:
        _check_prompt(body.get("prompt"))
    so = body.get("stream_options") or {}
    return ParsedRequest(
        kind=kind,
        body=body,
        raw=raw,
        model=model,
        stream=bool(body.get("stream", False)),
        include_usage=bool(so.get("include_usage", False)),
    )


def normalize_upstream_error(status: int, raw: bytes, request_id: str = "") -> bytes:
    """vLLM's error bodies use ``type: BadRequestError`` and numeric codes; rewrite them to
    OpenAI's shape (``invalid_request_error`` for 4xx, ``server_error`` for 5xx) keeping vLLM's
    message and param; a 5xx message carries the request id, as the gateway's own 5xx do."""
    try:
        err = msgspec.json.decode(raw).get("error", {})
        message = str(err.get("message") or "invalid request")
        param = err.get("param")
    except (msgspec.DecodeError, AttributeError):
        message, param = raw.decode("utf-8", "replace")[:500] or "invalid request", None
    type_ = "invalid_request_error" if status < 500 else "server_error"
    if status >= 500 and request_id:
        message = f"{message} (request id {request_id})"
    if isinstance(param, str) and param.startswith("body."):
        param = param[5:]
    return error_body(message, type_, param if isinstance(param, str) else None, None)
