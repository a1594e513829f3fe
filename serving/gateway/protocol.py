"""OpenAI wire checks the gateway owns. Imports nothing from ray, vllm or torch.

The gateway parses a request body once, checks what it routes on and what the engine would
mishandle (vLLM accepts unknown chat roles, for example), and forwards the original bytes untouched
unless it must rewrite the model name. Everything else (sampling parameters, context length)
is validated by vLLM itself, whose 4xx answers are normalised on their way back
(:func:`serving.gateway.answers.normalize_upstream_error`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

import msgspec

from serving.errors import ErrorShape, InvalidRequest
from serving.gateway.admission.reserve import chat_bound, reservation, text_bounds
from serving.gateway.answers import StreamTap, Tap

__all__ = ["Forwardable", "ParsedRequest", "decode_body", "parse_request", "type_name"]


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

    def reserve_tokens(self, max_model_len: int) -> tuple[int, int]:
        """(prompt, completion) tokens admission reserves against the tenant's TPM: the most this
        request may be billed (:mod:`serving.gateway.admission.reserve`)."""
        ...

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
COMPLETION_MAX_TOKENS = 16  # vLLM's CompletionRequest.max_tokens when a request sets none (or null)
# what a chat template renders into the prompt besides the messages (vLLM passes tools and
# documents to the template)
_CHAT_PROMPT = ("messages", "tools", "functions", "documents")


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

    def reserve_tokens(self, max_model_len: int) -> tuple[int, int]:
        """(prompt, completion) tokens admission reserves against a tenant's TPM, bounded as
        :mod:`serving.gateway.admission.reserve` says. The completion limit: chat's
        ``max_completion_tokens`` or ``max_tokens`` (the context length when it sets neither),
        completions' ``max_tokens`` only (vLLM's ``CompletionRequest`` ignores
        ``max_completion_tokens``; 16 when absent or null, its default), ``n`` of them per prompt
        (each string or token-id array of a completions ``prompt`` is one). Embeddings generate
        nothing: their input is all prompt."""
        if self.kind == "chat":
            limit = self.body.get("max_completion_tokens") or self.body.get("max_tokens") or max_model_len
            prompt = chat_bound((self.body.get(k) for k in _CHAT_PROMPT), max_model_len)
            return reservation([prompt], int(limit), self.n, max_model_len)
        if self.kind == "completion":
            limit = self.body.get("max_tokens") or COMPLETION_MAX_TOKENS
            return reservation(text_bounds(self.body.get("prompt")), int(limit), self.n, max_model_len)
        return reservation(text_bounds(self.body.get("input")), 0, 1, max_model_len)

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
