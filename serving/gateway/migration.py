"""Stream migration: a stream whose replica dies mid-answer is continued on another replica of
the same model version, so the client sees one answer.

How: a stream that can be continued (:func:`blocker`) is sent to the engine with
``return_token_ids``, and :class:`Splice` watches it on its way to the client. It keeps the prompt's
token ids (in the first chunk) and the ids of every token sent, and cuts the ids out again unless
the client asked for them itself (the array becomes ``null``, the bytes the engine sends without the
flag). When the stream breaks after its first byte (a read error, the replica's lease died, or
vLLM's own 5xx error event for a dead engine, which the relay confirms with ``/health``), the
splice resubmits, through the same leaser (so the same Serve application, i.e. the same version):

- a completion whose prompt is the prompt's ids plus the ids already sent, with the request's own
  sampling parameters and seed (:data:`SAMPLING`) and the tokens left of its limit;
- or, when nothing had reached the client yet, the original request as it was.

The continuation's completion chunks are rewritten into the client's format (chat deltas or
completion text) with the first leg's ``id``, ``created`` and ``model``; its usage is rewritten to
count the original prompt once and every token sent once, and that is what is billed. The client
sees one role chunk, one ``[DONE]``, no gap in the text. Greedy decoding gives the text an
uninterrupted run gives (up to the engine's batch-dependent arithmetic, as between any two runs).

Left out, so ended with the SSE error event as before: ``n > 1``, tools and tool calls,
``response_format`` and structured outputs (a grammar's state cannot be handed over), logprobs
(the continuation would need the first leg's top-k), ``stop`` strings and chunks whose tokens came
without their text (text the engine held back would be lost), beam search, ``echo``/``suffix``,
several prompts in one request. The continuation counts the tokens sent as prompt, so
``presence_penalty``/``frequency_penalty`` (which look only at output tokens) restart there, and a
seeded sampler restarts its random stream: only greedy output is the same as without the cut.

At most ``gateway.max_migrations`` per request, each spending one retry of the gateway's retry
budget; every decision is counted in ``raystack_stream_migrations`` (outcome: resumed, failed,
refused).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from serving.errors import GatewayError, UpstreamError, sse_error_event
from serving.gateway.protocol import Kind, ParsedRequest
from serving.gateway.relay import Observer, UpstreamResult

logger = logging.getLogger("serving.gateway")

__all__ = ["SAMPLING", "Plan", "Splice", "blocker"]

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
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "return_token_ids": True,
        }
        if self.min_tokens:
            body["min_tokens"] = max(0, self.min_tokens - sent)
        return msgspec.json.encode(body)


class _Delta(msgspec.Struct):
    role: str | None = None
    content: str | None = None
    tool_calls: list[Any] | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None


class _Choice(msgspec.Struct):
    index: int = 0
    text: str | None = None
    delta: _Delta | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class _Chunk(msgspec.Struct):
    id: str = ""
    created: int = 0
    model: str = ""
    choices: list[_Choice] = msgspec.field(default_factory=list)
    prompt_token_ids: list[int] | None = None


_decode = msgspec.json.Decoder(_Chunk)
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


def _server_error(ev: bytes) -> bool:
    try:
        code = msgspec.json.decode(ev[6:]).get("error", {}).get("code")
    except (msgspec.DecodeError, AttributeError):
        return False
    return isinstance(code, int) and code >= 500


class Splice:
    """The observer of a stream that may be continued elsewhere: it wraps the request's own
    observer (the exchange: usage, billing, metrics), which sees the client's bytes only, and
    finishes it once, when the last leg ends. :meth:`stream` runs the legs."""

    def __init__(
        self,
        exchange: Observer,
        plan: Plan,
        resume: Resume,
        request_id: str,
        *,
        max_migrations: int,
        allow: Callable[[], bool],
        count: Callable[[str], None],
    ) -> None:
        self.exchange, self.plan, self._resume, self.request_id = exchange, plan, resume, request_id
        self.max_migrations, self._allow, self._count = max_migrations, allow, count
        self._buf = b""
        self._held: list[bytes] = []  # a 5xx error event of the engine and what followed it
        self.id: str | None = None
        self.created, self.model = 0, ""
        self.prompt: list[int] | None = None
        self.sent: list[int] = []
        self._template: bytes | None = None  # the last text chunk the client got
        self._bare: bool | None = None  # chat: a token without text came as an empty delta (a parser)
        self._texted = 0  # tokens sent up to the last chunk with text
        self._forwarded = False
        self._finished = False
        self._blocked: str | None = None
        self._translate = False  # the current leg is a continuation (completion chunks)
        self.cut = False  # the leg that just ended broke, and the next one is committed
        self.migrations = 0

    @property
    def held_error(self) -> bool:
        return bool(self._held)

    def feed(self, chunk: bytes) -> bytes:
        data = self._buf + chunk if self._buf else chunk
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self._buf = data
            return b""
        events, self._buf = data[:cut], data[cut + 2 :]
        out = b"".join(e + b"\n\n" for e in map(self._event, events.split(b"\n\n")) if e)
        return self.exchange.feed(out) if out else b""

    def flush(self) -> bytes:
        tail = b"".join(e + b"\n\n" for e in self._held) + self._buf
        self._held, self._buf = [], b""
        return (self.exchange.feed(tail) if tail else b"") + self.exchange.flush()

    def failed(self, request_id: str) -> bytes:
        why = self._why_not()
        self._held, self._buf = [], b""
        if why is None:
            self.cut = True
            return b""
        self._count("refused")
        logger.warning("[%s] stream not continued elsewhere: %s", request_id, why)
        return self.exchange.failed(request_id)

    def retried(self) -> None:
        self.exchange.retried()

    def finish(self, status: int, body: bytes | None = None) -> None:
        if self.cut and status != 499:
            return  # the next leg finishes the request
        self.exchange.finish(status if status in (200, 499) or not self.migrations else 502, body)

    def _why_not(self) -> str | None:
        if self.migrations >= self.max_migrations:
            return f"limit of {self.max_migrations} migrations reached"
        if self._blocked:
            return self._blocked
        if self._finished:
            return "the answer was complete"
        if self._forwarded and (self.prompt is None or self.plan.body(self.prompt + self.sent, len(self.sent)) is None):
            return "no prompt token ids or no tokens left"
        if not self._allow():
            return "retry budget spent"
        return None

    def _event(self, ev: bytes) -> bytes:
        if self._held:  # what follows an engine error is not the client's yet
            self._held.append(ev)
            return b""
        if ev.startswith(b'data: {"error"'):
            if _server_error(ev):
                self._held.append(ev)
                return b""
            return ev
        if not ev.startswith(b"data: {"):
            return ev  # [DONE]
        try:
            chunk = _decode.decode(ev[6:])
        except msgspec.DecodeError:
            self._blocked = "an event that does not parse"
            return ev
        return self._continued(ev, chunk) if self._translate else self._passed(ev, chunk)

    def _note(self, choice: _Choice, text: str | None) -> None:
        d = choice.delta
        if d is not None and (d.tool_calls or d.reasoning or d.reasoning_content):
            self._blocked = "tool call or reasoning deltas"
        if choice.token_ids is None:
            if d is None or d.role is None:  # the role chunk has no tokens
                self._blocked = "a chunk without token ids"
        else:
            self.sent.extend(choice.token_ids)
        if text or self.plan.kind == "completion":
            self._texted = len(self.sent)
        if choice.finish_reason is not None:
            self._finished = True

    def _passed(self, ev: bytes, chunk: _Chunk) -> bytes:
        """An event in the client's format (the first leg's, or a resent original's)."""
        if self.id is None:
            self.id, self.created, self.model = chunk.id, chunk.created, chunk.model
        bare = False
        for c in chunk.choices:
            if self.prompt is None:
                self.prompt = chunk.prompt_token_ids or c.prompt_token_ids
            text = c.text if self.plan.kind == "completion" else (c.delta.content if c.delta else None)
            self._note(c, text)
            if text:
                self._template = ev
            if self.plan.kind == "chat" and c.token_ids and not text and c.finish_reason is None:
                bare = self._bare = c.delta == _Delta()
        self._forwarded = True
        if self.plan.client_ids:
            return ev
        # with token ids asked for, vLLM sends a chunk for a token whose text its parser holds
        # back (an empty delta); without, it sends none: neither does the splice
        return b"" if bare else null_ids(ev)

    def _continued(self, ev: bytes, chunk: _Chunk) -> bytes:
        """A continuation's completion chunk, rewritten as the next chunk of the client's stream."""
        src = msgspec.json.decode(ev[6:])
        if chunk.choices:
            c = chunk.choices[0]
            self._note(c, c.text)
            bare = self.plan.kind == "chat" and self._bare and not c.text and c.finish_reason is None
            if bare and not self.plan.client_ids:
                return b""  # as vLLM's chat sends no chunk for it
            out = self._client_chunk(src["choices"][0], c.text or "")
        else:  # the final usage event
            out = {**src, "id": self.id, "object": self._object(), "created": self.created, "model": self.model}
        if isinstance(src.get("usage"), dict):
            out["usage"] = self._usage(out.get("usage") if chunk.choices else None, src["usage"])
        return b"data: " + msgspec.json.encode(out)

    def _object(self) -> str:
        return "chat.completion.chunk" if self.plan.kind == "chat" else "text_completion"

    def _usage(self, shape: Any, leg: dict[str, Any]) -> dict[str, Any]:
        """The usage the client sees and is billed: the original prompt once, every token sent
        once (in the first leg's chunks' shape, ``shape``, when there is one)."""
        prompt, done = len(self.prompt or ()), len(self.sent)
        base = shape if isinstance(shape, dict) else leg
        return {**base, "prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    def _client_chunk(self, src: dict[str, Any], text: str) -> dict[str, Any]:
        ids = src.get("token_ids") if self.plan.client_ids else None
        base: dict[str, Any] = msgspec.json.decode(self._template[6:]) if self._template else {}
        choice: dict[str, Any] = {"index": 0}
        if self.plan.kind == "chat":
            delta = {k: v for k, v in ((base.get("choices") or [{}])[0].get("delta") or {}).items() if k != "role"}
            delta = {} if self._bare and not text else {**delta, "content": text}
            choice |= {"delta": delta, "logprobs": None, "finish_reason": src.get("finish_reason")}
            if src.get("finish_reason") is not None:
                choice["stop_reason"] = src.get("stop_reason")
            choice["token_ids"] = ids
        else:
            choice = {**src, "prompt_token_ids": None, "token_ids": ids}
        head = {"id": self.id, "object": self._object(), "created": self.created, "model": self.model}
        return {**head, **{k: v for k, v in base.items() if k not in head}, "choices": [choice]}

    async def stream(self, first: UpstreamResult) -> AsyncIterator[bytes]:
        """The client's stream: the first leg, then each continuation the legs before committed."""
        legs = [first]
        try:
            while True:
                assert legs[-1].stream is not None
                async for out in legs[-1].stream:
                    yield out
                if not self.cut:
                    return
                nxt = await self._next_leg()
                if isinstance(nxt, bytes):
                    yield nxt
                    return
                legs.append(nxt)
        finally:
            for leg in legs:
                close = getattr(leg.stream, "aclose", None)
                if close is not None:
                    await close()
                if leg.aclose is not None:
                    await leg.aclose()
            self.exchange.finish(499)  # no-op unless the client left between two legs

    async def _next_leg(self) -> UpstreamResult | bytes:
        self.cut, self.migrations = False, self.migrations + 1
        if self._forwarded and self.prompt is not None:
            # chat: the tokens after the last text are generated again, since a parser may hold
            # their text back (e.g. a possible tool-call tag); it reaches the client this time
            del self.sent[self._texted :]
            path, body = "/v1/completions", self.plan.body(self.prompt + self.sent, len(self.sent))
            self._translate = True
        else:
            path, body = self.plan.path, self.plan.original
        assert body is not None  # checked by _why_not
        logger.info("[%s] continuing the stream on another replica after %d tokens", self.request_id, len(self.sent))
        try:
            leg = await self._resume(path, body, self)
        except GatewayError as exc:
            self._count("failed")
            return sse_error_event(exc, self.request_id)
        if leg.stream is None:  # the replica answered with an error of its own
            self._count("failed")
            return sse_error_event(
                UpstreamError("The model replica failed while streaming; the response is incomplete."), self.request_id
            )
        self._count("resumed")
        return leg


def spliced(result: UpstreamResult, splice: Splice) -> UpstreamResult:
    """``result`` (the first leg) with its stream run through ``splice``."""
    return dataclasses.replace(result, stream=splice.stream(result))
