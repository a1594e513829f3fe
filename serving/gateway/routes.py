"""The OpenAI-compatible HTTP surface: thin routes over :class:`GatewayCore`.

``create_api(core)`` returns a plain ASGI app (:class:`GatewayApp`), so tests can drive it
in-process through ``httpx.ASGITransport``; the Serve deployment (:mod:`serving.gateway.deployment`)
serves the same app. The forwarding routes (chat, completions, embeddings) are raw ASGI endpoints
(they carry every token); the rest is FastAPI. The routes of the agent APIs (Responses, Messages,
tokenize) are added by :mod:`serving.gateway.agent_routes` through the same generate endpoint;
the admin routes (promotion status, admin keys only) by :mod:`serving.gateway.admin`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from serving.errors import (
    BodyTooLarge,
    ErrorShape,
    GatewayError,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    to_response,
)
from serving.gateway.admin import AdminAccess, add_admin_routes
from serving.gateway.admission.auth import Tenant
from serving.gateway.core import GatewayCore
from serving.gateway.protocol import Forwardable, parse_request
from serving.gateway.relay import UpstreamResult

logger = logging.getLogger("serving.gateway")

__all__ = ["ErrorRenderer", "Flow", "Generate", "GatewayApp", "create_api", "request_id", "tenant_of"]

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
        started = time.monotonic()
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
            done = await _unless_client_leaves(
                core.complete(parsed, resolved, tenant, self.path, rid, session_id=_header(scope, b"x-session-id")),
                receive,
            )
            if done is None:
                logger.info("[%s] the client left before the answer; the request was cancelled", rid)
                return
            result, extra = done
            if self.flow is not None:
                result = await self.flow.finish(result, state, tenant)
        except GatewayError as exc:
            return await self._error(exc, rid)(scope, receive, send)
        except Exception as exc:  # never a stack trace to the client
            logger.exception("[%s] unexpected error", rid)
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


class GatewayApp:
    """The gateway's ASGI app: POSTs to the forwarding routes go straight to :class:`Generate`;
    everything else (and lifespan) to the FastAPI app in ``api``, which routes the same
    endpoints too (so a method other than POST gets its OpenAI-shaped 405)."""

    def __init__(self, api: FastAPI, generate: dict[str, Generate]) -> None:
        self.api, self._generate = api, generate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self._generate.get(scope["path"])
            if handler is not None:
                return await handler(scope, receive, send)
        await self.api(scope, receive, send)


def create_api(
    core: GatewayCore, set_request_id_header: bool | None = None, admin: AdminAccess | None = None
) -> GatewayApp:
    """The routes over ``core``. ``set_request_id_header``: echo ``x-request-id`` on responses
    (default: ``core.settings``; off behind Serve's proxy, which does it itself). ``admin``: where
    the admin routes read the promotion record, and their keys (None: no admin routes, 404)."""
    app = FastAPI(title="raystack-llm gateway", docs_url=None, redoc_url=None)
    rid_header = core.set_request_id_header if set_request_id_header is None else set_request_id_header

    def _error(exc: BaseException, rid: str, shape: ErrorShape = "openai") -> Response:
        resp = to_response(exc, rid, shape)
        if resp.status >= 500:
            logger.error("[%s] %s: %s", rid, type(exc).__name__, exc)
        headers = {**resp.headers, "x-request-id": rid} if rid_header else dict(resp.headers)
        if core.settings.expose_replica_header:
            headers["x-gateway-replica"] = core.replica_id
        return Response(resp.body, resp.status, headers, media_type=_JSON)

    @app.exception_handler(StarletteHTTPException)
    async def _http_exc(request: Request, exc: StarletteHTTPException) -> Response:
        rid = _request_id(request)
        shape: ErrorShape = "anthropic" if request.url.path.startswith("/v1/messages") else "openai"
        if exc.status_code == 405:
            return _error(MethodNotAllowed(f"Method {request.method} is not allowed here."), rid, shape)
        if exc.status_code == 404:
            return _error(NotFound(f"Unknown path {request.url.path}."), rid, shape)
        return _error(InvalidRequest(str(exc.detail)), rid, shape)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return _error(InvalidRequest(str(exc.errors()[:1])), _request_id(request))

    generate = {
        "/v1/chat/completions": Generate(core, "chat", "/v1/chat/completions", rid_header, _error),
        "/v1/completions": Generate(core, "completion", "/v1/completions", rid_header, _error),
        "/v1/embeddings": Generate(core, "embedding", "/v1/embeddings", rid_header, _error),
    }
    from serving.gateway.agent_routes import add_agent_routes

    generate |= add_agent_routes(app, core, rid_header, _error)
    add_admin_routes(app, admin, lambda: core.auth, _error, _request_id)
    for path, handler in generate.items():
        app.router.routes.append(Route(path, handler, methods=["POST"]))

    def _visible(request: Request) -> list[tuple[str, dict[str, object]]]:
        tenant = tenant_of(core, request)
        return [(i, core.routes.model_card(i)) for i, m in core.routes.model_ids() if tenant.allows(m.name)]

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            data = [card for _, card in _visible(request)]
        except GatewayError as exc:
            return _error(exc, _request_id(request))
        return Response(msgspec.json.encode({"object": "list", "data": data}), media_type=_JSON)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> Response:
        try:
            for i, card in _visible(request):
                if i == model_id:
                    return Response(msgspec.json.encode(card), media_type=_JSON)
        except GatewayError as exc:
            return _error(exc, _request_id(request))
        return _error(
            NotFound(
                f"The model '{model_id}' does not exist or you do not have access to it.",
                param="model",
                code="model_not_found",
            ),
            _request_id(request),
        )

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/-/healthz")
    async def healthz() -> Response:  # the path KubeRay's readiness probe asks on the serve port
        return Response(b"success", media_type="text/plain")

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        ok = await core.ready()
        body = b'{"status":"ready"}' if ok else b'{"status":"not ready"}'
        return Response(body, 200 if ok else 503, media_type=_JSON)

    return GatewayApp(app, generate)
