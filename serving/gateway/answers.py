"""The engine's answers on their way back through the gateway. Imports nothing from ray, vllm or
torch.

A streamed answer is passed on whole SSE events at a time (:func:`whole_events`), through a tap
that reads the usage it carries and cuts out what the client did not ask for (:class:`StreamTap`);
a whole answer's usage is read once (:func:`usage_of`); an engine's error body is rewritten to the
route's error shape (:func:`normalize_upstream_error`).
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from serving.errors import ErrorShape, anthropic_error_body, error_body

__all__ = ["StreamTap", "Tap", "normalize_upstream_error", "usage_of", "whole_events"]


class Tap(Protocol):
    """Event-aligned pass-through of a streamed answer that reads the usage it carries.

    ``counts_output``: whether :attr:`usage` counts the output so far (a final or running usage);
    False while it holds only what the stream reported before its output (the input tokens)."""

    @property
    def usage(self) -> dict[str, Any] | None: ...

    @property
    def counts_output(self) -> bool: ...

    def feed(self, chunk: bytes) -> bytes: ...

    def flush(self) -> bytes: ...


_USAGE = b'"usage":{'
_INDEX = b'"index":'


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

    __slots__ = ("_buf", "_choices", "final", "keep_chunk_usage", "strip_usage")
    counts_output = True  # a chunk's usage is cumulative, its completion tokens included

    def __init__(self, strip_usage: bool, keep_chunk_usage: bool = False) -> None:
        self._buf = b""
        self.strip_usage = strip_usage
        self.keep_chunk_usage = keep_chunk_usage and not strip_usage
        self.final: dict[str, Any] | None = None
        self._choices: dict[int, tuple[int, int]] = {}  # choice index -> (prompt, completion) tokens

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
