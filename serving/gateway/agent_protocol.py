"""Wire checks of the APIs agent clients speak: OpenAI's Responses, Anthropic's Messages (and its
``count_tokens``), and vLLM's ``/tokenize`` and ``/detokenize``. Imports nothing from ray, vllm
or torch.

As for chat (:mod:`serving.gateway.protocol`) the gateway parses what it routes and bills on and
forwards the rest for vLLM to validate. Each request type satisfies
:class:`serving.gateway.protocol.Forwardable`, so these requests take the chat path through the
gateway core: auth, the tenant's models, RPM/TPM, shedding, retries and failover, metrics.

Billing (what :meth:`AgentRequest.tokens` counts against TPM):

- Responses: ``input_tokens`` (cached tokens are part of it) + ``output_tokens``.
- Messages: ``input_tokens`` + ``cache_creation_input_tokens`` + ``cache_read_input_tokens`` +
  ``output_tokens``: in Anthropic's format ``input_tokens`` leaves cached tokens out, so billing it
  alone would let prefix caching escape the limit.
- ``count_tokens``, ``/tokenize``, ``/detokenize``: a request against RPM, no tokens (they run no
  generation; :attr:`AgentRequest.bills_tokens` is False).

A stream's usage is final only in its last usage event (Responses: ``response.completed``,
``.incomplete`` or ``.failed``; Messages: ``message_delta``). A Messages stream's
``message_start`` reports its input tokens with ``output_tokens: 0``: a stream that ends before
``message_delta`` is billed those input tokens and, if its client left, its reservation for the
output (:meth:`serving.gateway.core.Exchange.finish`), so leaving a stream late escapes no tokens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Literal

import msgspec

from serving.errors import ErrorShape, InvalidRequest
from serving.gateway.admission.reserve import chat_bound, reservation
from serving.gateway.answers import first_error, whole_events
from serving.gateway.protocol import decode_body, type_name

__all__ = ["AgentKind", "AgentRequest", "EventTap", "parse_agent_request"]

AgentKind = Literal["responses", "messages", "count_tokens", "tokenize", "detokenize"]
_SHAPES: dict[str, ErrorShape] = {"responses": "responses", "messages": "anthropic", "count_tokens": "anthropic"}
_LIMIT_FIELD = {"responses": "max_output_tokens", "messages": "max_tokens"}
# what the engine renders into the prompt (admission reserves their bound: serving.gateway.admission.reserve)
_PROMPT_FIELDS = {"responses": ("instructions", "input", "tools"), "messages": ("system", "messages", "tools")}
_GENERATES = frozenset({"responses", "messages"})
# the events whose usage is cumulative and final for the whole answer
_FINAL_USAGE = {
    "responses": (b"response.completed", b"response.incomplete", b"response.failed"),
    "messages": (b"message_delta",),
}
# the events whose usage counts the input only, before any output (module docstring)
_INPUT_USAGE = {"messages": (b"message_start",)}
_SEQUENCE = b'"sequence_number":'
# an error event (Responses: ``{"type": "error", "code": ...}``; Messages: ``{"type": "error",
# "error": {"type": ...}}``): a data line ends in ``}``, so these bytes only begin an event
_ERROR_EVENT = b"event: error\n"


class EventTap:
    """Pass-through of a named-event SSE stream (``event: X\\ndata: {...}\\n\\n``, the format of
    Responses and Messages streams), released at event boundaries, that keeps the usage of the
    events that carry it (:data:`_FINAL_USAGE`, :data:`_INPUT_USAGE`) and, for Responses, the
    final response object. Messages streams report input tokens in ``message_start`` and the
    totals in ``message_delta``; the latest value of each field wins. :attr:`counts_output` is
    False until a final usage event came: :attr:`usage` then holds the input tokens only.
    :attr:`error`: the status the first ``error`` event of the engine stands for
    (:func:`serving.gateway.answers.error_status`); the event reaches the client unchanged."""

    __slots__ = ("_buf", "_final", "_names", "counts_output", "error", "kind", "response", "sequence", "usage")

    def __init__(self, kind: str) -> None:
        self.kind, self._buf = kind, b""
        self._final = _FINAL_USAGE.get(kind, ())
        self._names = self._final + _INPUT_USAGE.get(kind, ())
        self.usage: dict[str, Any] | None = None
        self.counts_output = False
        self.response: dict[str, Any] | None = None  # the Responses stream's final response object
        self.sequence = -1  # the last ``sequence_number`` a Responses event carried
        self.error: int | None = None

    def feed(self, chunk: bytes) -> bytes:
        out, self._buf = whole_events(self._buf, chunk)
        if not out:
            return b""
        if self.kind == "responses":  # an error event the gateway ends a stream with comes next in order
            at = out.rfind(_SEQUENCE)
            if at >= 0:
                digits = re.match(rb"\s*(\d+)", out[at + len(_SEQUENCE) :])
                self.sequence = int(digits.group(1)) if digits else self.sequence
        if self.error is None and _ERROR_EVENT in out:
            self.error = first_error(out, _ERROR_EVENT)
        if b'"usage"' in out:
            for ev in out.split(b"\n\n"):
                self._read(ev)
        return out

    def flush(self) -> bytes:
        out, self._buf = self._buf, b""
        return out

    def _read(self, ev: bytes) -> None:
        head, _, data = ev.partition(b"\ndata: ")
        name = head.removeprefix(b"event: ").strip()
        if name not in self._names or not data:
            return
        try:
            payload = msgspec.json.decode(data)
        except msgspec.DecodeError:
            return
        holder = payload.get("response") or payload.get("message") or payload
        usage = holder.get("usage") if isinstance(holder, dict) else None
        if not isinstance(usage, dict):
            usage = payload.get("usage")
        if isinstance(usage, dict):
            self.usage = {**(self.usage or {}), **{k: v for k, v in usage.items() if v is not None}}
            self.counts_output = self.counts_output or name in self._final
        if self.kind == "responses" and isinstance(payload.get("response"), dict):
            self.response = payload["response"]


@dataclass(frozen=True)
class AgentRequest:
    """A parsed Responses, Messages, count_tokens, tokenize or detokenize request."""

    kind: AgentKind
    body: dict[str, Any]
    raw: bytes
    model: str | None
    stream: bool
    changed: bool = False  # the body was rewritten (a Responses follow-up expanded): re-encode it

    @property
    def n(self) -> int:
        return 1

    @property
    def error_shape(self) -> ErrorShape:
        return _SHAPES.get(self.kind, "openai")

    @property
    def bills_tokens(self) -> bool:
        return self.kind in _GENERATES

    def prompt_text(self, limit: int = 4096) -> str:
        """Leading prompt text, only for prefix-affinity routing (never logged)."""
        parts: list[str] = []
        for key in ("instructions", "system", "prompt", "input"):
            v = self.body.get(key)
            if isinstance(v, str):
                parts.append(v)
        items = self.body.get("messages") if "messages" in self.body else self.body.get("input")
        for m in items if isinstance(items, list) else []:
            c = m.get("content") if isinstance(m, dict) else None
            parts.append(c if isinstance(c, str) else "")
            if sum(map(len, parts)) >= limit:
                break
        return "".join(parts)[:limit]

    def reserve_tokens(self, max_model_len: int) -> tuple[int, int]:
        """As chat's (:meth:`serving.gateway.protocol.ParsedRequest.reserve_tokens`): the prompt
        fields' bound and one completion of the body's limit (the context length when unset)."""
        field = _LIMIT_FIELD.get(self.kind)
        if field is None:
            return 0, 0
        prompt = chat_bound((self.body.get(k) for k in _PROMPT_FIELDS[self.kind]), max_model_len)
        return reservation([prompt], int(self.body.get(field) or max_model_len), 1, max_model_len)

    def with_body(self, body: dict[str, Any]) -> AgentRequest:
        return replace(self, body=body, changed=True)

    def salted(self, salt: str) -> AgentRequest:
        return self.with_body({**self.body, "cache_salt": salt}) if self.kind in _GENERATES else self

    def upstream_body(self, name: str) -> bytes:
        if self.body.get("model") == name and not self.changed:
            return self.raw
        return msgspec.json.encode({**self.body, "model": name})

    def tap(self) -> EventTap | None:
        return EventTap(self.kind) if self.stream else None

    def tokens(self, usage: dict[str, Any]) -> tuple[int, int]:
        """(input, output) tokens to bill (module docstring)."""
        if not self.bills_tokens:
            return 0, 0
        prompt = int(usage.get("input_tokens") or 0)
        if self.kind == "messages":
            prompt += int(usage.get("cache_creation_input_tokens") or 0)
            prompt += int(usage.get("cache_read_input_tokens") or 0)
        return prompt, int(usage.get("output_tokens") or 0)


def _require(body: dict[str, Any], key: str, types: tuple[type, ...], what: str) -> None:
    v = body.get(key)
    if v is None:
        raise InvalidRequest(f"'{key}' is a required property", param=key)
    if isinstance(v, bool) or not isinstance(v, types) or (isinstance(v, (str, list)) and not v):
        raise InvalidRequest(f"'{key}' must be {what}, not {type_name(v)}", param=key)


def _check(kind: AgentKind, body: dict[str, Any]) -> None:
    for key in ("max_output_tokens", "max_tokens"):
        v = body.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise InvalidRequest(f"'{key}' must be a positive integer", param=key)
    v = body.get("stream")
    if v is not None and not isinstance(v, bool):
        raise InvalidRequest(f"'stream' must be a boolean, not {type_name(v)}", param="stream")
    if v and kind not in _GENERATES:  # the engine answers these with one JSON body, never a stream
        raise InvalidRequest(f"'stream' is not supported for {kind} requests", param="stream")
    if kind == "responses":
        _require(body, "input", (str, list), "a non-empty string or array of items")
        if body.get("background"):
            raise InvalidRequest("'background' responses are not supported by this gateway.", param="background")
        prev = body.get("previous_response_id")
        if prev is not None and (not isinstance(prev, str) or not prev):
            raise InvalidRequest("'previous_response_id' must be a non-empty string", param="previous_response_id")
        if body.get("store") is not None and not isinstance(body["store"], bool):
            raise InvalidRequest(f"'store' must be a boolean, not {type_name(body['store'])}", param="store")
        if body.get("conversation") is not None:  # vLLM would ignore it; the gateway keeps no conversation objects
            raise InvalidRequest(
                "'conversation' is not supported by this gateway; use 'previous_response_id'.", param="conversation"
            )
    elif kind in ("messages", "count_tokens"):
        _require(body, "messages", (list,), "a non-empty array of messages")
        if kind == "messages":
            _require(body, "max_tokens", (int,), "a positive integer")
    elif kind == "tokenize":
        if body.get("prompt") is None and body.get("messages") is None:
            raise InvalidRequest("'prompt' or 'messages' is required", param="prompt")
    else:
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise InvalidRequest("'tokens' must be an array of integers", param="tokens")


def parse_agent_request(raw: bytes, kind: AgentKind) -> AgentRequest:
    """Parse and check a request body of one of these APIs; raise :class:`InvalidRequest`."""
    body, model = decode_body(raw)
    _check(kind, body)
    return AgentRequest(kind=kind, body=body, raw=raw, model=model, stream=bool(body.get("stream", False)))
