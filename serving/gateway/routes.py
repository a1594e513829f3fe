"""The forwarding routes of the OpenAI-compatible HTTP surface (chat, completions, embeddings, and
through the same endpoint the agent APIs of :mod:`serving.gateway.agent_routes`): raw ASGI
endpoints over :class:`GatewayCore` (:class:`Generate`), since they carry every token, and what
every route shares (request ids, the caller's tenant, error rendering). :mod:`serving.gateway.api`
assembles them into the gateway's app.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

from serving.errors import (
    BodyTooLarge,
    ErrorShape,
    GatewayError,
)
from serving.gateway.admission.auth import Tenant
from serving.gateway.core import GatewayCore
from serving.gateway.protocol import Forwardable, parse_request
from serving.gateway.relay import UpstreamResult

logger = logging.getLogger("serving.gateway")

__all__ = ["ErrorRenderer", "Flow", "Generate", "request_id", "tenant_of"]

_JSON = "application/json"
ErrorRenderer = Callable[[BaseException, str, ErrorShape], Response]


class Flow(Protocol):
    """Work a route does around the forwarded request (the Responses API's conversation state):
    ``prepare`` may rewrite the request before it is admitted and forwarded; ``finish`` sees the
    answer (a body, or a stream to wrap) before the client does."""

    async def prepare(self, parsed: Any, tenant: Tenant) -> tuple[Any, Any]: ...

    async def finish(self, result: UpstreamResult, state: Any, tenant: Tenant) -> UpstreamResult: ...


def _valid_request_id(rid: str) -> str:
    if rid and len(rid) <= 128 and rid.isascii() and rid.isprintable():
        return rid
    return uuid.uuid4().hex


def _request_id(request: Request) -> str:
    return _valid_request_id(request.headers.get("x-request-id", ""))


request_id = _request_id


def tenant_of(core: GatewayCore, request: Request) -> Tenant:
    """The tenant of a FastAPI route's request (either key header)."""
    return core.auth.authenticate(request.headers.get("authorization"), request.headers.get("x-api-key"))


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope["headers"]:
        if k == name:
            return str(v.decode("latin-1"))
    return None


async def _read_body(scope: Scope, receive: Receive, limit: int) -> bytes | None:
    """The request body, or None if the client went away first."""
    declared = _header(scope, b"content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"The request body is larger than the limit of {limit} bytes.")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"The request body is larger than the limit of {limit} bytes.")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _stream(result: UpstreamResult, headers: dict[str, str], receive: Receive, send: Send) -> None:
    """Send a streamed answer chunk by chunk, straight to the server's ``send``.

    Not Starlette's StreamingResponse: per chunk it adds two middleware ``send`` wrappers and a
    task group to the relay, the gateway's hottest path (docs/performance.md, "The relay"). A
    client that goes away cancels the relay (which ends the upstream request); the lease is
    released however the stream ends."""
    task = asyncio.current_task()
    assert task is not None and result.stream is not None
    state = {"sending": True, "gone": False}

    async def watch_disconnect() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if state["sending"]:
            state["gone"] = True
            task.cancel()

    watcher = asyncio.ensure_future(watch_disconnect())
    raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    raw.append((b"content-type", b"text/event-stream; charset=utf-8"))
    try:
        await send({"type": "http.response.start", "status": 200, "headers": raw})
        async for chunk in result.stream:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except asyncio.CancelledError:
        if not state["gone"]:
            raise
        task.uncancel()  # the client went away: nothing left to send to
    finally:
        state["sending"] = False
        watcher.cancel()
        close_stream = getattr(result.stream, "aclose", None)
        if close_stream is not None:  # a relay left at a ``yield`` runs its cleanup now, not at GC
            await close_stream()
        if result.aclose is not None:
            await result.aclose()


async def _unless_client_leaves(
    work: Awaitable[tuple[UpstreamResult, dict[str, str]]], receive: Receive
) -> tuple[UpstreamResult, dict[str, str]] | None:
    """Await ``work`` (the request up to its answer or first byte) unless the client disconnects
    first: then ``work`` is cancelled, which closes the upstream connection, and vLLM aborts the
    request (a non-streamed request's engine work stops with its client). None if it left."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    try:
        result, _ = await task
    except BaseException:  # noqa: BLE001 - cancelled (the usual case) or failed: nothing to send
        return None
    if result.aclose is not None:  # it finished just as the client left: release what it holds
        await result.aclose()
    return None


class Generate:
    """A forwarding route as one raw ASGI endpoint (the per-request and per-chunk path): chat,
    completions and embeddings here, the agent APIs through :mod:`serving.gateway.agent_routes`
    (``parse`` makes their request, ``flow`` adds their state)."""

    def __init__(
        self,
        core: GatewayCore,
        kind: str,
        path: str,
        rid_header: bool,
        error: Callable[[BaseException, str], Response],
        parse: Callable[[bytes], Forwardable] | None = None,
        flow: Flow | None = None,
    ) -> None:
        self.core, self.kind, self.path, self.rid_header, self._error = core, kind, path, rid_header, error
        self.parse = parse or functools.partial(parse_request, kind=kind)  # type: ignore[arg-type]
        self.flow = flow

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        core = self.core
        rid = _valid_request_id(_header(scope, b"x-request-id") or "")
        started = time.monotonic()  # the request's arrival: its TTFT and latency start here
        tenant: Tenant | None = None
        done = None
        try:
            tenant = core.auth.authenticate(_header(scope, b"authorization"), _header(scope, b"x-api-key"))
            raw = await _read_body(scope, receive, core.settings.max_body_bytes)
            if raw is None:
                return  # the client left before sending its request
            parsed = self.parse(raw)
            resolved = core.authorize(tenant, parsed.model)
            state = None
            if self.flow is not None:
                parsed, state = await self.flow.prepare(parsed, tenant)
            session = _header(scope, b"x-session-id")
            done = await _unless_client_leaves(
                core.complete(parsed, resolved, tenant, self.path, rid, session_id=session, arrived=started), receive
            )
            if done is None:
                logger.info("[%s] the client left before the answer; the request was cancelled", rid)
                return
            result, extra = done
            if self.flow is not None:
                result = await self.flow.finish(result, state, tenant)
        except GatewayError as exc:
            if done is None:  # refused before its exchange counted it (core.complete marks those it did)
                core.refused(exc, tenant)
            return await self._error(exc, rid)(scope, receive, send)
        except Exception as exc:  # never a stack trace to the client
            logger.exception("[%s] unexpected error", rid)
            if done is None:
                core.refused(exc, tenant)
            return await self._error(exc, rid)(scope, receive, send)
        headers = {**extra, "x-model-version": resolved.version.version}
        if self.rid_header:
            headers["x-request-id"] = rid
        if core.settings.expose_replica_header:
            headers["x-replica"] = result.replica
            headers["x-replica-route"] = result.route
            headers["x-upstream-attempts"] = str(result.attempts)
            headers["x-gateway-replica"] = core.replica_id
        if logger.isEnabledFor(logging.INFO):
            logger.info(
                "[%s] %s tenant=%s model=%s@%s replica=%s (%s) attempts=%d %.1fms",
                rid,
                self.kind,
                tenant.name,
                resolved.model.name,
                resolved.version.version,
                result.replica,
                result.route,
                result.attempts,
                (time.monotonic() - started) * 1000,
            )
        if result.stream is not None:
            headers["cache-control"] = "no-cache"
            return await _stream(result, headers, receive, send)
        await Response(result.body, result.status, headers, media_type=_JSON)(scope, receive, send)
