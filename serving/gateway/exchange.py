"""One forwarded request's bookkeeping (:class:`Exchange`: usage, timings, quota use, metrics),
and the count of the requests the gateway refuses before there is one (:func:`count_refused`)."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from serving.errors import GatewayError, UpstreamError, sse_error_event
from serving.gateway.admission.auth import Tenant
from serving.gateway.admission.quota import QuotaClient
from serving.gateway.answers import usage_of
from serving.gateway.protocol import Forwardable
from serving.gateway.routing import Resolved

__all__ = ["Exchange", "choices_of", "count_refused", "counted"]

_COUNTED = "_raystack_counted"  # set on an exception whose request a metric already counts


def counted(exc: BaseException) -> None:
    """Mark ``exc`` as counted (by its exchange, or as rate-limited or shed): the route that
    answers it does not count it again as refused (:func:`count_refused`)."""
    setattr(exc, _COUNTED, True)


def count_refused(metrics: Any, exc: BaseException, tenant: Tenant | None) -> None:
    """Count a request the gateway answered with an error before an exchange counted it (401,
    404, 400/413, a fail-closed quota 503, an unexpected 500), in ``raystack_refused_requests``.
    Its labels are bounded: the tenant's config name ("-" before authentication), the status
    class, and the error's fixed code (its type when it has none; ``server_error`` for an
    unexpected one), never the client's input."""
    if metrics is None or getattr(exc, _COUNTED, False):
        return
    if isinstance(exc, GatewayError):
        status, reason = exc.status, exc.code or exc.type
    else:
        status, reason = 500, "server_error"
    tags = {"tenant": tenant.name if tenant is not None else "-", "status_class": f"{status // 100}xx"}
    metrics.refused.inc(tags={**tags, "reason": reason})


def choices_of(parsed: Forwardable) -> int:
    """The completions generated in parallel: ``n`` per prompt (a completions ``prompt`` may be an
    array of strings or of token-id arrays: one prompt each)."""
    prompt = parsed.body.get("prompt") if parsed.kind == "completion" else None
    prompts = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else 1
    return max(parsed.n, 1) * prompts


class Exchange:
    """One request's bookkeeping: usage, timings, quota use and metrics, finished exactly once.

    It holds the request's place in ``in_flight`` (the gateway's per-model count, which shedding
    reads) from its creation to :meth:`finish`, and is given what it reports to: the quota client
    and the metrics (None in unit use). ``arrived``: when the route got the request (monotonic), so
    TTFT and end-to-end latency include admission (the quota's round trip, kv_aware tokenizing)."""

    def __init__(
        self,
        parsed: Forwardable,
        resolved: Resolved,
        tenant: Tenant,
        *,
        in_flight: Counter[str],
        quota: QuotaClient,
        metrics: Any = None,
        ticket: int = 0,
        reserved: tuple[int, int] = (0, 0),
        arrived: float | None = None,
    ) -> None:
        self.parsed, self.tenant = parsed, tenant
        self.in_flight, self.quota, self.metrics = in_flight, quota, metrics
        self.ticket, self.reserved = ticket, reserved  # the TPM reservation (prompt, completion), settled in finish
        self.model, self.version = resolved.model.name, resolved.version.version
        self.pinned = resolved.pinned
        self.started = time.monotonic() if arrived is None else arrived
        self.first_at: float | None = None
        self.last_at = self.started
        self.tap = parsed.tap()
        self.usage: dict[str, Any] | None = None
        self.counted: dict[str, Any] | None = None  # the tokens a splice counted (:meth:`count`)
        self._done = False
        self.engine_asked = False  # a replica was leased for it (set by the request's leaser)
        self.in_flight[self.model] += 1
        if metrics:
            metrics.in_flight.set(self.in_flight[self.model], tags={"model": self.model, "kind": "all"})

    def feed(self, chunk: bytes) -> bytes:
        now = time.monotonic()
        if self.first_at is None:
            self.first_at = now
        self.last_at = now
        return self.tap.feed(chunk) if self.tap else chunk

    held_error = False  # error events pass through to the client as the engine sent them

    def count(self, prompt: int, completion: int) -> None:
        """The stream's tokens as the splice counted them from their ids: what is billed when no
        usage event came (the engine is not asked for usage on every chunk of such a stream)."""
        self.counted = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def flush(self) -> bytes:
        return self.tap.flush() if self.tap else b""

    def failed(self, request_id: str) -> bytes:
        """The error event that ends a broken stream. The bytes after the last whole event are
        dropped: they are part of an event the engine never finished, which would garble this one."""
        self.flush()
        return sse_error_event(
            UpstreamError("The model replica failed while streaming; the response is incomplete."),
            request_id,
            self.parsed.error_shape,
            getattr(self.tap, "sequence", -1) + 1,
        )

    def retried(self) -> None:
        m = self.metrics
        if m:
            m.retries.inc(tags={"model": self.model, "version": self.version})

    def finish(self, status: int, body: bytes | None = None) -> None:
        """Settle the quota and record the metrics. A stream the engine ended with an error event
        (the tap's ``error``) is counted by that error's status, with no TTFT or ITL, though the
        client got a 200 and left after it or read to its end; it is billed as any stream."""
        if self._done:
            return
        self._done = True
        self.in_flight[self.model] -= 1
        usage = self.tap.usage if self.tap else (usage_of(body) if body and status == 200 else None)
        self.usage = usage if usage is not None else self.counted
        prompt, completion = self.parsed.tokens(self.usage) if self.usage is not None else (0, 0)
        tokens = prompt + completion
        # no usage, or a stream's usage of its input only (a Messages stream's message_start)
        output_unknown = self.usage is None or (
            usage is not None and self.tap is not None and not self.tap.counts_output
        )
        if output_unknown and status == 499 and self.engine_asked:
            # a client that left before its output was counted, once an engine may have run: bill
            # the input known so far and the output's reservation, within the whole reservation
            # (all of it if no input is known), so the reservation bounds what it is billed
            whole = sum(self.reserved)
            tokens = whole if self.usage is None else max(tokens, min(tokens + self.reserved[1], whole))
        if self.tenant.tpm is not None or self.ticket:
            self.quota.record(self.tenant.name, tokens if self.tenant.tpm is not None else 0, self.ticket)
        m = self.metrics
        if m is None:
            return
        error = self.tap.error if self.tap else None
        if error is not None and status in (200, 499):
            status = error
        tags = m.tags(self.model, self.version, self.tenant.name, self.pinned)
        m.requests.inc(tags={**tags, "status_class": f"{status // 100}xx"})
        m.api_requests.inc(tags={"api": self.parsed.kind, **tags, "status_class": f"{status // 100}xx"})
        m.e2e.observe(time.monotonic() - self.started, tags=tags)
        m.in_flight.set(self.in_flight[self.model], tags={"model": self.model, "kind": "all"})
        if self.usage:
            # Ray's Counter.inc refuses 0 (an embedding has no completion tokens)
            if prompt > 0:
                m.prompt_tokens.inc(prompt, tags=tags)
            if completion > 0:
                m.completion_tokens.inc(completion, tags=tags)
        if self.tap and self.first_at is not None and status == 200:
            m.ttft.observe(self.first_at - self.started, tags=tags)
            # the choices are generated in parallel: the span holds each one's tokens, not all
            steps = completion / choices_of(self.parsed) - 1
            if steps >= 1:
                m.itl.observe((self.last_at - self.first_at) / steps, tags=tags)
