"""The engine's answers on their way back through the gateway. Imports nothing from ray, vllm or
torch.

A streamed answer is passed on whole SSE events at a time (:func:`whole_events`), through a tap
that reads the usage it carries, notes an error event of the engine (:func:`error_status`) and
cuts out what the client did not ask for (:class:`StreamTap`);
a whole answer's usage is read once (:func:`usage_of`); an engine's error body is rewritten to the
route's error shape (:func:`normalize_upstream_error`).
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from serving.errors import ErrorShape, anthropic_error_body, error_body

__all__ = ["StreamTap", "Tap", "error_status", "first_error", "normalize_upstream_error", "usage_of", "whole_events"]


class Tap(Protocol):
    """Event-aligned pass-through of a streamed answer that reads the usage it carries.

    ``counts_output``: whether :attr:`usage` counts the output so far (a final or running usage);
    False while it holds only what the stream reported before its output (the input tokens).
    ``error``: the HTTP status the stream's first error event of the engine stands for
    (:func:`error_status`), None while none came: the request is counted by it, not as a 200."""

    @property
    def usage(self) -> dict[str, Any] | None: ...

    @property
    def error(self) -> int | None: ...

    @property
    def counts_output(self) -> bool: ...

    def feed(self, chunk: bytes) -> bytes: ...

    def flush(self) -> bytes: ...


_USAGE = b'"usage":{'
_INDEX = b'"index":'
# an engine's error event in an OpenAI stream (vLLM: ``data: {"error": {..., "code": 500}}``): a
# JSON string escapes its quotes, so these bytes start an event's data, never a token's text
ERROR_DATA = b'data: {"error"'
# the error types of a client's mistake (OpenAI's, Anthropic's, vLLM's), for an error event that
# carries no numeric code; any other counts as the server's (5xx)
_CLIENT_ERRORS = frozenset(
    {
        "invalid_request_error",
        "authentication_error",
        "permission_error",
        "not_found_error",
        "request_too_large",
        "rate_limit_error",
        "rate_limit_exceeded",
        "BadRequestError",
        "NotFoundError",
    }
)


def error_status(ev: bytes) -> int:
    """The HTTP status an engine's error event stands for: its numeric ``code`` (an OpenAI-format
    error's, as vLLM sends it), 400 to 599 (a code below counts as 400, above as 500); without
    one, 400 for a client's mistake by its type or code (:data:`_CLIENT_ERRORS`), else 500.
    Parsed only when an error event came: the taps look for its bytes alone."""
    try:
        payload = msgspec.json.decode(ev.partition(b"data: ")[2])
    except msgspec.DecodeError:
        return 500
    err = payload.get("error") if isinstance(payload, dict) else None
    err = err if isinstance(err, dict) else payload if isinstance(payload, dict) else {}
    code = err.get("code")
    if isinstance(code, str) and code.isdigit():
        code = int(code)
    if isinstance(code, int) and not isinstance(code, bool):
        return code if 400 <= code <= 599 else 400 if code < 400 else 500
    kinds = (code, err.get("type"))
    return 400 if any(isinstance(k, str) and k in _CLIENT_ERRORS for k in kinds) else 500


def first_error(out: bytes, marker: bytes) -> int:
    """:func:`error_status` of the first event of ``out`` (whole events) that ``marker`` opens."""
    at = out.find(marker)
    end = out.find(b"\n\n", at)
    return error_status(out[at : end if end >= 0 else len(out)])


def _object_end(ev: bytes, start: int) -> int:
    """Index after the JSON object that opens at ``ev[start]`` (usage objects hold no strings)."""
    end = ev.find(b"}", start)
    while end >= 0 and ev.count(b"{", start, end) > ev.count(b"}", start, end) + 1:
        end = ev.find(b"}", end + 1)
    return end + 1 if end >= 0 else -1


class StreamTap:
    """Event-aligned pass-through of an SSE byte stream that reads the usage it carries.

    The engine is asked for a final usage-only event and, unless the splice counts the stream's
    tokens (:meth:`ParsedRequest.upstream_body`), for usage on every chunk (per choice,
    cumulative); the tap keeps the latest per choice, so :attr:`usage` is what the stream used so
    far even if it never reaches its end. What the client did not ask for is cut out at
    the byte level: ``strip_usage`` (no ``include_usage``) removes the chunks' usage and the final
    usage event; otherwise, without ``keep_chunk_usage`` (no ``continuous_usage_stats``), only
    the chunks' usage. Bytes are released at event boundaries (``\n\n``) only.
    """

    __slots__ = ("_buf", "_choices", "error", "final", "keep_chunk_usage", "strip_usage")
    counts_output = True  # a chunk's usage is cumulative, its completion tokens included

    def __init__(self, strip_usage: bool, keep_chunk_usage: bool = False) -> None:
        self._buf = b""
        self.strip_usage = strip_usage
        self.keep_chunk_usage = keep_chunk_usage and not strip_usage
        self.final: dict[str, Any] | None = None
        self._choices: dict[int, tuple[int, int]] = {}  # choice index -> (prompt, completion) tokens
        self.error: int | None = None  # the status of the engine's first error event (Tap)

    @property
    def usage(self) -> dict[str, Any] | None:
        """The final usage event's, else the sum of the chunks' latest per choice."""
        if self.final is not None or not self._choices:
            return self.final
        prompt = max(p for p, _ in self._choices.values())
        completion = sum(c for _, c in self._choices.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def feed(self, chunk: bytes) -> bytes:
        out, self._buf = whole_events(self._buf, chunk)
        if not out:
            return b""
        if self.error is None and ERROR_DATA in out:  # passed on unchanged, as the engine sent it
            self.error = first_error(out, ERROR_DATA)
        return self._take_usage(out) if _USAGE in out else out

    def flush(self) -> bytes:
        out, self._buf = self._buf, b""
        return out

    def _take_usage(self, out: bytes) -> bytes:
        kept: list[bytes] = []
        for ev in out.split(b"\n\n"):
            at = ev.find(_USAGE)
            end = _object_end(ev, at + 8) if at >= 0 and ev.startswith(b"data: {") else -1
            if end < 0:
                kept.append(ev)
                continue
            try:
                usage = msgspec.json.decode(ev[at + 8 : end])
            except msgspec.DecodeError:
                kept.append(ev)
                continue
            if b'"choices":[]' in ev:  # the final usage-only event
                self.final = usage
                if not self.strip_usage:
                    kept.append(ev)
                continue
            self._note(ev, usage)
            if self.keep_chunk_usage:
                kept.append(ev)
            elif ev[at - 1 : at] == b",":
                kept.append(ev[: at - 1] + ev[end:])
            else:
                kept.append(ev[:at] + ev[end:].removeprefix(b","))
        return b"\n\n".join(kept)

    def _note(self, ev: bytes, usage: dict[str, Any]) -> None:
        i = ev.find(_INDEX)  # the first "index" of a chunk is its choice's
        digits = ev[i + 8 : i + 14].split(b",")[0].split(b"}")[0].strip() if i >= 0 else b"0"
        idx = int(digits) if digits.isdigit() else 0
        self._choices[idx] = (int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0))


def usage_of(body: bytes) -> dict[str, Any] | None:
    """The ``usage`` object of a non-streamed response body, if any."""
    try:
        u = msgspec.json.decode(body).get("usage")
    except (msgspec.DecodeError, AttributeError):
        return None
    return u if isinstance(u, dict) else None


def whole_events(buf: bytes, chunk: bytes) -> tuple[bytes, bytes]:
    """The complete SSE events of ``buf + chunk`` (each ending in its blank line), and the rest: a
    stream's bytes are released at event boundaries, however the network cut them."""
    data = buf + chunk if buf else chunk
    cut = data.rfind(b"\n\n")
    if cut < 0:
        return b"", data
    return data[: cut + 2], data[cut + 2 :]


def normalize_upstream_error(status: int, raw: bytes, request_id: str = "", shape: ErrorShape = "openai") -> bytes:
    """vLLM's error bodies use ``type: BadRequestError`` and numeric codes; rewrite them to
    OpenAI's shape (``invalid_request_error`` for 4xx, ``server_error`` for 5xx) keeping vLLM's
    message and param, or to Anthropic's for the Messages routes; a 5xx message carries the
    request id, as the gateway's own 5xx do."""
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
    if shape == "anthropic":
        return anthropic_error_body(status, message)
    return error_body(message, type_, param if isinstance(param, str) else None, None)
