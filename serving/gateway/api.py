"""The OpenAI-compatible HTTP surface: thin routes over :class:`GatewayCore`.

``create_api(core)`` returns a plain FastAPI app, so tests can drive it in-process through
``httpx.ASGITransport``; the Serve deployment (:mod:`serving.gateway.deployment`) serves the same app.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.errors import (
    BodyTooLarge,
    GatewayError,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    to_response,
)
from serving.gateway.core import GatewayCore
from serving.gateway.proxy import UpstreamResult
from serving.protocol import Kind, parse_request

logger = logging.getLogger("serving.gateway")

__all__ = ["create_api"]

_JSON = "application/json"


def _request_id(request: Request) -> str:
    rid = request.headers.get("x-request-id", "")
    if rid and len(rid) <= 128 and rid.isascii() and rid.isprintable():
        return rid
    return uuid.uuid4().hex


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"The request body is larger than the limit of {limit} bytes.")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"The request body is larger than the limit of {limit} bytes.")
        chunks.append(chunk)
    return b"".join(chunks)


class _Stream(StreamingResponse):
    """A streamed answer whose lease is released even if the stream never runs to its end."""

    def __init__(self, result: UpstreamResult, headers: dict[str, str]) -> None:
        assert result.stream is not None
        super().__init__(result.stream, 200, headers, media_type="text/event-stream")
        self._aclose = result.aclose

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self._aclose is not None:
                await self._aclose()


def create_api(core: GatewayCore, set_request_id_header: bool | None = None) -> FastAPI:
    """The routes over ``core``. ``set_request_id_header``: echo ``x-request-id`` on responses
    (default: ``core.settings``; off behind Serve's proxy, which does it itself)."""
    app = FastAPI(title="raystack-llm gateway", docs_url=None, redoc_url=None)
    rid_header = core.settings.set_request_id_header if set_request_id_header is None else set_request_id_header

    def _error(exc: BaseException, rid: str) -> Response:
        resp = to_response(exc, rid)
        if resp.status >= 500:
            logger.error("[%s] %s: %s", rid, type(exc).__name__, exc)
        headers = {**resp.headers, "x-request-id": rid} if rid_header else dict(resp.headers)
        if core.settings.expose_replica_header:
            headers["x-gateway-replica"] = core.settings.replica_id
        return Response(resp.body, resp.status, headers, media_type=_JSON)

    @app.exception_handler(StarletteHTTPException)
    async def _http_exc(request: Request, exc: StarletteHTTPException) -> Response:
        rid = _request_id(request)
        if exc.status_code == 405:
            return _error(MethodNotAllowed(f"Method {request.method} is not allowed here."), rid)
        if exc.status_code == 404:
            return _error(NotFound(f"Unknown path {request.url.path}."), rid)
        return _error(InvalidRequest(str(exc.detail)), rid)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return _error(InvalidRequest(str(exc.errors()[:1])), _request_id(request))

    async def _generate(request: Request, kind: Kind, path: str) -> Response:
        rid = _request_id(request)
        started = time.monotonic()
        try:
            tenant = core.auth.authenticate(request.headers.get("authorization"))
            raw = await _read_body(request, core.settings.max_body_bytes)
            parsed = parse_request(raw, kind)
            resolved = core.authorize(tenant, parsed.model)
            result, extra = await core.complete(parsed, resolved, tenant, path, rid,
                                                session_id=request.headers.get("x-session-id"))  # fmt: skip
        except GatewayError as exc:
            return _error(exc, rid)
        except Exception as exc:  # never a stack trace to the client
            logger.exception("[%s] unexpected error", rid)
            return _error(exc, rid)
        headers = {**extra, "x-model-version": resolved.version.version}
        if rid_header:
            headers["x-request-id"] = rid
        if core.settings.expose_replica_header:
            headers["x-replica"] = result.replica
            headers["x-replica-route"] = result.route
            headers["x-gateway-replica"] = core.settings.replica_id
        logger.info("[%s] %s tenant=%s model=%s@%s replica=%s (%s) attempts=%d %.1fms", rid, kind,
                    tenant.name, resolved.model.name, resolved.version.version, result.replica,
                    result.route, result.attempts, (time.monotonic() - started) * 1000)  # fmt: skip
        if result.stream is not None:
            headers["cache-control"] = "no-cache"
            return _Stream(result, headers)
        return Response(result.body, result.status, headers, media_type=_JSON)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _generate(request, "chat", "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(request, "completion", "/v1/completions")

    def _model_card(model_id: str, root: str, created: int, max_len: int) -> dict[str, object]:
        return {"id": model_id, "object": "model", "created": created, "owned_by": "raystack",
                "root": root, "max_model_len": max_len}  # fmt: skip

    def _visible(request: Request) -> list[tuple[str, dict[str, object]]]:
        tenant = core.auth.authenticate(request.headers.get("authorization"))
        return [(i, _model_card(i, m.name, m.created, m.max_model_len))
                for i, m in core.routes.model_ids() if tenant.allows(m.name)]  # fmt: skip

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
        return _error(NotFound(f"The model '{model_id}' does not exist or you do not have access to it.",
                               param="model", code="model_not_found"), _request_id(request))  # fmt: skip

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

    return app
