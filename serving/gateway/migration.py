"""Stream migration: a stream whose replica dies mid-answer is continued on another replica of
the same model version, so the client sees one answer.

How: a stream that can be continued (:func:`blocker`) is sent to the engine with
``return_token_ids``, and the splice (:mod:`serving.gateway.splice`) watches it on its way to the
client. It keeps the prompt's token ids (first chunk) and the ids of every token sent, and turns
the id arrays back into ``null`` unless the client asked for them (the bytes the engine sends
without the flag; chat's extra empty-delta chunks, sent only with the flag, are dropped). When the
stream breaks after its first byte (a read error, the replica's lease died, or vLLM's own 5xx error
event for a dead engine, which the relay confirms with ``/health``), the splice resubmits through
the request's own leaser, i.e. to the same Serve application, the same version:

- a completion (:meth:`Plan.body`) whose prompt is the prompt's ids plus the ids sent, with the
  request's own sampling parameters and seed (:data:`SAMPLING`) and the tokens left of its limit.
  Chat first drops the tokens sent after the last chunk with text, so that text a parser held back
  (a possible tool-call tag) is generated again and reaches the client; completions hold nothing
  back once ``stop`` strings are excluded (the continuation's detokenizer is primed with its prompt,
  so a character split across the cut is completed);
- or, when nothing had reached the client yet, the original request as it was.

The continuation's chunks are rewritten into the client's format (chat deltas or completion text)
with the first leg's ``id``, ``created`` and ``model``; usage counts the original prompt once and
every token sent once, and that is what is billed. The splice counts those tokens from their ids,
so such a stream asks the engine for its final usage event only, not for usage on every chunk
(unless the client asked for that). The client sees one role chunk, one
``[DONE]``. Greedy output is the text an uninterrupted run gives.

Left out, so ended with the SSE error event as before (docs/architecture.md, "Stream migration"):
``n > 1``, tools and tool-call or reasoning deltas, ``response_format`` and structured outputs,
logprobs, ``stop`` strings, beam search, ``echo``/``suffix``, several prompts in one request.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from serving.gateway.protocol import Kind, ParsedRequest
from serving.gateway.relay import Observer, UpstreamResult

__all__ = ["SAMPLING", "Chunk", "Delta", "Plan", "Resume", "blocker", "decode_chunk", "null_ids", "server_error"]

# Request fields a continuation carries over: both endpoints take them with the same meaning.
SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "priority",
    "cache_salt",
    "user",
)
_STRUCTURED = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
COMPLETION_DEFAULT_MAX_TOKENS = 16  # vLLM's default for /v1/completions

Resume = Callable[[str, bytes, Observer], Awaitable[UpstreamResult]]


def blocker(parsed: ParsedRequest) -> str | None:
    """Why this request's stream cannot be continued elsewhere (None: it can)."""
    b = parsed.body
    prompt = b.get("prompt")
    checks = (
        (not parsed.stream, "not streamed"),
        (parsed.n > 1, "n > 1"),
        (bool(b.get("tools") or b.get("functions")), "tools"),
        (b.get("response_format") not in (None, {"type": "text"}), "response_format"),
        (any(b.get(k) is not None for k in _STRUCTURED), "structured output"),
        (b.get("logprobs") not in (None, False) or bool(b.get("top_logprobs") or b.get("prompt_logprobs")), "logprobs"),
        (bool(b.get("stop")), "stop strings"),
        (bool(b.get("use_beam_search")) or b.get("best_of") not in (None, 1), "beam search"),
        (bool(b.get("echo") or b.get("suffix")), "echo or suffix"),
        (isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int), "several prompts"),
    )
    return next((why for hit, why in checks if hit), None)


@dataclass(frozen=True)
class Plan:
    """What a continuation of one request needs from it."""

    kind: Kind
    path: str
    model: str  # the engine's served name
    original: bytes  # the body the first leg sent (resent as is when nothing reached the client)
    sampling: dict[str, Any]
    limit: int | None  # the request's completion token limit, if it set one
    min_tokens: int
    context: int  # the model's max_model_len
    client_ids: bool  # the client asked for token ids itself
    chunk_usage: bool  # the client asked for usage on every chunk (continuous_usage_stats)

    @classmethod
    def of(cls, parsed: ParsedRequest, path: str, model: str, context: int) -> Plan:
        b = parsed.body
        limit = b.get("max_completion_tokens") or b.get("max_tokens")
        return cls(
            kind=parsed.kind,
            path=path,
            model=model,
            original=parsed.upstream_body(model, token_ids=True),
            sampling={k: b[k] for k in SAMPLING if b.get(k) is not None},
            limit=int(limit) if limit else None,
            min_tokens=int(b.get("min_tokens") or 0),
            context=context,
            client_ids=bool(b.get("return_token_ids")),
            chunk_usage=parsed.continuous_usage,
        )

    def body(self, prompt: list[int], sent: int) -> bytes | None:
        """The continuation: a completion of ``prompt`` (the original prompt's ids and the ``sent``
        ids after it) for the tokens left; None when none are left."""
        if self.limit is not None:
            limit = self.limit
        elif self.kind == "completion":
            limit = COMPLETION_DEFAULT_MAX_TOKENS
        else:  # chat's default: the rest of the context
            limit = self.context - (len(prompt) - sent)
        left = min(limit - sent, self.context - len(prompt))
        if left < 1:
            return None
        body: dict[str, Any] = {
            **self.sampling,
            "model": self.model,
            "prompt": prompt,
            "max_tokens": left,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": self.chunk_usage},
            "return_token_ids": True,
        }
        if self.min_tokens:
            body["min_tokens"] = max(0, self.min_tokens - sent)
        return msgspec.json.encode(body)


class Delta(msgspec.Struct):
    """What the splice reads of a stream chunk (the rest of the JSON is left alone)."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[Any] | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None


class Choice(msgspec.Struct):
    index: int = 0
    text: str | None = None
    delta: Delta | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class Chunk(msgspec.Struct):
    id: str = ""
    created: int = 0
    model: str = ""
    choices: list[Choice] = msgspec.field(default_factory=list)
    prompt_token_ids: list[int] | None = None


decode_chunk = msgspec.json.Decoder(Chunk).decode
_IDS = (b'"prompt_token_ids":[', b'"token_ids":[')


def null_ids(ev: bytes) -> bytes:
    """The event with its token-id arrays replaced by ``null`` (how vLLM sends them unasked)."""
    for key in _IDS:
        at = ev.find(key)
        while at >= 0:
            end = ev.find(b"]", at)
            ev = ev[: at + len(key) - 1] + b"null" + ev[end + 1 :]
            at = ev.find(key, at)
    return ev


def server_error(ev: bytes) -> bool:
    """Whether the event is an error event with a 5xx code (vLLM's for a dead engine, among others)."""
    try:
        code = msgspec.json.decode(ev[6:]).get("error", {}).get("code")
    except (msgspec.DecodeError, AttributeError):
        return False
    return isinstance(code, int) and code >= 500
