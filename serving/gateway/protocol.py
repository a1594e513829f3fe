"""OpenAI wire checks the gateway owns. Imports nothing from ray, vllm or torch.

The gateway parses a request body once, checks what it routes on and what the engine would
mishandle (vLLM accepts unknown chat roles, for example), and forwards the original bytes untouched
unless it must rewrite the model name. Everything else (sampling parameters, context length)
is validated by vLLM itself, whose 4xx answers are normalised by :func:`normalize_upstream_error`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

import msgspec

from serving.errors import ErrorShape, InvalidRequest, anthropic_error_body, error_body

__all__ = [
    "Forwardable",
    "ParsedRequest",
    "StreamTap",
    "Tap",
    "decode_body",
    "normalize_upstream_error",
    "parse_request",
    "type_name",
    "usage_of",
    "whole_events",
]


class Tap(Protocol):
    """Event-aligned pass-through of a streamed answer that reads the usage it carries."""

    @property
    def usage(self) -> dict[str, Any] | None: ...

    def feed(self, chunk: bytes) -> bytes: ...

    def flush(self) -> bytes: ...


class Forwardable(Protocol):
    """What :meth:`serving.gateway.core.GatewayCore.complete` needs of a parsed request, whatever
    its API (chat and completions here; Responses, Messages and tokenize in
    :mod:`serving.gateway.agent_protocol`)."""

    @property
    def kind(self) -> str: ...

    @property
    def body(self) -> dict[str, Any]: ...

    @property
    def raw(self) -> bytes: ...

    @property
    def model(self) -> str | None: ...

    @property
    def stream(self) -> bool: ...

    @property
    def n(self) -> int: ...

    @property
    def error_shape(self) -> ErrorShape: ...

    @property
    def bills_tokens(self) -> bool: ...

    def prompt_text(self, limit: int = 4096) -> str: ...

    def reserve_tokens(self, max_model_len: int) -> int: ...

    def upstream_body(self, name: str) -> bytes: ...

    def salted(self, salt: str) -> Forwardable:
        """This request with vLLM's ``cache_salt`` set to ``salt`` where the engine computes a
        prompt's KV blocks (generating and embedding requests); unchanged otherwise (tokenize)."""
        ...

    def tap(self) -> Tap | None: ...

    def tokens(self, usage: dict[str, Any]) -> tuple[int, int]: ...


Kind = Literal["chat", "completion", "embedding"]
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
_INT_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens", "n", "seed", "top_logprobs")
_MAX_TOKEN_ID = 2**63 - 1  # token ids beyond int64 are no engine's: refused here, not crashed on
_NUM_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty")


@dataclass(frozen=True)
class ParsedRequest:
    kind: Kind
    body: dict[str, Any]
    raw: bytes
    model: str | None
    stream: bool
    include_usage: bool
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (with include_usage)
    changed: bool = False  # the body was rewritten (cache_salt set): re-encode it

    def prompt_text(self, limit: int = 4096) -> str:
        """Leading prompt text, only for prefix-affinity routing (never logged)."""
        if self.kind != "chat":
            p = self.body.get("prompt" if self.kind == "completion" else "input")
            p = p[0] if isinstance(p, list) and p else p
            return p[:limit] if isinstance(p, str) else ""
        parts: list[str] = []
        for m in self.body.get("messages", []):
            c = m.get("content")
            parts.append(c if isinstance(c, str) else "")
            if sum(map(len, parts)) >= limit:
                break
        return "".join(parts)[:limit]

    @property
    def n(self) -> int:
        return int(self.body.get("n") or 1)

    def salted(self, salt: str) -> ParsedRequest:
        # embeddings too: vLLM caches a causal embedding model's prompt blocks as well
        return replace(self, body={**self.body, "cache_salt": salt}, changed=True)

    @property
    def error_shape(self) -> ErrorShape:
        return "openai"

    @property
    def bills_tokens(self) -> bool:
        return True

    def tap(self) -> StreamTap | None:
        if not self.stream:
            return None
        return StreamTap(strip_usage=not self.include_usage, keep_chunk_usage=self.continuous_usage)

    def tokens(self, usage: dict[str, Any]) -> tuple[int, int]:
        """(prompt, completion) tokens of an OpenAI ``usage`` object."""
        return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)

    def reserve_tokens(self, max_model_len: int) -> int:
        """Completion tokens this request may use at most: ``n`` x its token limit (the context
        length when it sets none); what admission reserves against a tenant's TPM. Embeddings
        generate none: like a prompt's, their input tokens are billed when the answer says them."""
        if self.kind == "embedding":
            return 0
        limit = self.body.get("max_completion_tokens") or self.body.get("max_tokens") or max_model_len
        return self.n * int(limit)

    def upstream_body(self, name: str, token_ids: bool = False) -> bytes:
        """The body to forward: ``model`` set to the engine's served name and, for streams, usage
        always requested, so the gateway bills what a stream used even when it is abandoned or
        cut (:class:`StreamTap` strips what the client did not ask for): on every chunk
        (``continuous_usage_stats``), unless ``token_ids``. Then the engine sends each chunk's
        token ids (``return_token_ids``), which a stream needs to be continued on another replica
        and from which the splice counts the tokens (:mod:`serving.gateway.migration`, which
        strips the ids again), so only the final usage event is asked for. Unchanged bodies are
        forwarded as the same bytes."""
        so = self.body.get("stream_options") or {}
        want = ("include_usage",) if token_ids else ("include_usage", "continuous_usage_stats")
        force_usage = self.stream and not all(so.get(k) for k in want)
        force_ids = token_ids and not self.body.get("return_token_ids")
        if self.body.get("model") == name and not force_usage and not force_ids and not self.changed:
            return self.raw
        body = {**self.body, "model": name}
        if force_ids:
            body["return_token_ids"] = True
        if force_usage:
            body["stream_options"] = {**so, **dict.fromkeys(want, True)}
        return msgspec.json.encode(body)


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


def type_name(v: object) -> str:
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
            raise InvalidRequest(f"'{key}' must be an integer, not {type_name(v)}", param=key)
    for key in ("max_tokens", "max_completion_tokens", "n"):
        v = body.get(key)
        if v is not None and v < 1:
            raise InvalidRequest(f"'{key}' must be at least 1, got {v}", param=key)
    v = body.get("min_tokens")
    if v is not None and v < 0:
        raise InvalidRequest(f"'min_tokens' must be at least 0, got {v}", param="min_tokens")
    for key in _NUM_FIELDS:
        v = body.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise InvalidRequest(f"'{key}' must be a number, not {type_name(v)}", param=key)
    for key in ("stream",):
        v = body.get(key)
        if v is not None and not isinstance(v, bool):
            raise InvalidRequest(f"'{key}' must be a boolean, not {type_name(v)}", param=key)
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise InvalidRequest("'stream_options' must be an object", param="stream_options")


def _check_messages(messages: object) -> None:
    if messages is None:
        raise InvalidRequest("'messages' is a required property", param="messages")
    if not isinstance(messages, list):
        raise InvalidRequest(f"'messages' must be an array, not {type_name(messages)}", param="messages")
    if not messages:
        raise InvalidRequest("'messages' must contain at least one message", param="messages")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InvalidRequest(f"'{where}' must be an object", param=where)
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:  # a list is unhashable: not a set lookup
            raise InvalidRequest(f"'{where}.role' must be one of {sorted(ROLES)}, got {role!r}", param=f"{where}.role")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise InvalidRequest(f"'{where}.content' must be a string or an array of parts", param=f"{where}.content")


def _token_ids(v: object) -> bool:
    return (
        isinstance(v, list)
        and bool(v)
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= _MAX_TOKEN_ID for t in v)
    )


def _text_or_ids(v: object) -> bool:
    """OpenAI's four forms of a prompt or an embeddings input: a string, or a non-empty array of
    strings, of token ids or of token id arrays (none of them empty)."""
    if isinstance(v, str):
        return v != ""
    return (
        isinstance(v, list)
        and bool(v)
        and (all(isinstance(p, str) and p for p in v) or _token_ids(v) or all(_token_ids(p) for p in v))
    )


def _check_prompt(prompt: object) -> None:
    if prompt is None:
        raise InvalidRequest("'prompt' is a required property", param="prompt")
    if not _text_or_ids(prompt):
        raise InvalidRequest(
            "'prompt' must be a non-empty string, or a non-empty array of strings, of token ids or of token id arrays",
            param="prompt",
        )


def _check_input(body: dict[str, Any]) -> None:
    """An embeddings ``input`` (the forms of :func:`_text_or_ids`); embeddings are never streamed."""
    inp = body.get("input")
    if inp is None:
        raise InvalidRequest("'input' is a required property", param="input")
    if not _text_or_ids(inp):
        raise InvalidRequest(
            "'input' must be a non-empty string, or a non-empty array of strings, of token ids or of token id arrays",
            param="input",
        )
    if body.get("stream"):
        raise InvalidRequest("'stream' is not supported for embeddings", param="stream")


def whole_events(buf: bytes, chunk: bytes) -> tuple[bytes, bytes]:
    """The complete SSE events of ``buf + chunk`` (each ending in its blank line), and the rest: a
    stream's bytes are released at event boundaries, however the network cut them."""
    data = buf + chunk if buf else chunk
    cut = data.rfind(b"\n\n")
    if cut < 0:
        return b"", data
    return data[: cut + 2], data[cut + 2 :]


def decode_body(raw: bytes) -> tuple[dict[str, Any], str | None]:
    """A request body as a JSON object and its ``model`` (a string or absent), whatever the API;
    raise :class:`InvalidRequest` otherwise."""
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}") from None
    except RecursionError:  # "[[[[...]]]]" deeper than msgspec recurses (tests/integration/test_fuzz.py)
        raise InvalidRequest("The request body is nested too deeply.") from None
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest(f"'model' must be a string, not {type_name(model)}", param="model")
    return body, model


def parse_request(raw: bytes, kind: Kind) -> ParsedRequest:
    """Parse and check a chat, completion or embeddings request body; raise :class:`InvalidRequest`."""
    body, model = decode_body(raw)
    _check_types(body)
    if kind == "chat":
        _check_messages(body.get("messages"))
    elif kind == "completion":
        _check_prompt(body.get("prompt"))
    else:
        _check_input(body)
    so = body.get("stream_options") or {}
    include_usage = bool(so.get("include_usage", False))
    return ParsedRequest(
        kind=kind,
        body=body,
        raw=raw,
        model=model,
        stream=bool(body.get("stream", False)),
        include_usage=include_usage,
        continuous_usage=include_usage and bool(so.get("continuous_usage_stats", False)),
    )


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
