"""The splice: the observer of a stream that may be continued on another replica, and the
client's stream over its legs (the mechanism: :mod:`serving.gateway.migration`)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import msgspec

from serving.errors import GatewayError, UpstreamError, sse_error_event
from serving.gateway.answers import whole_events
from serving.gateway.migration import Choice, Chunk, Delta, Plan, Resume, decode_chunk, null_ids, server_error
from serving.gateway.relay import Observer, UpstreamResult

logger = logging.getLogger("serving.gateway")

__all__ = ["Billed", "Splice", "spliced"]


class Billed(Observer, Protocol):
    """The request's own observer, which the splice also tells the tokens it counted."""

    def count(self, prompt: int, completion: int) -> None: ...


class Splice:
    """The observer of a stream that may be continued elsewhere: it wraps the request's own
    observer (the exchange: usage, billing, metrics), which sees the client's bytes only, and
    finishes it once, when the last leg ends. :meth:`stream` runs the legs."""

    def __init__(
        self,
        exchange: Billed,
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
        events, self._buf = whole_events(self._buf, chunk)
        if not events:
            return b""
        out = b"".join(e + b"\n\n" for e in map(self._event, events[:-2].split(b"\n\n")) if e)
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
        self._settle(status if status in (200, 499) or not self.migrations else 502, body)

    def _settle(self, status: int, body: bytes | None = None) -> None:
        """Finish the exchange with the tokens counted so far (billed if no usage event came)."""
        if self.prompt is not None:
            self.exchange.count(len(self.prompt), len(self.sent))
        self.exchange.finish(status, body)

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
            if server_error(ev):
                self._held.append(ev)
                return b""
            return ev
        if not ev.startswith(b"data: {"):
            return ev  # [DONE]
        try:
            chunk = decode_chunk(ev[6:])
        except msgspec.DecodeError:
            self._blocked = "an event that does not parse"
            return ev
        return self._continued(ev, chunk) if self._translate else self._passed(ev, chunk)

    def _note(self, choice: Choice, text: str | None) -> None:
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

    def _passed(self, ev: bytes, chunk: Chunk) -> bytes:
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
                bare = self._bare = c.delta == Delta()
        self._forwarded = True
        if self.plan.client_ids:
            return ev
        # with token ids asked for, vLLM sends a chunk for a token whose text its parser holds
        # back (an empty delta); without, it sends none: neither does the splice
        return b"" if bare else null_ids(ev)

    def _continued(self, ev: bytes, chunk: Chunk) -> bytes:
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
            self._settle(499)  # no-op unless the client left between two legs

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
