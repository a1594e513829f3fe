"""The gateway's HTTP app: the OpenAI-compatible surface over :class:`GatewayCore`.

``create_api(core)`` returns a plain ASGI app (:class:`GatewayApp`), so tests can drive it
in-process through ``httpx.ASGITransport``; the Serve deployment (:mod:`serving.gateway.deployment`)
serves the same app. The forwarding routes (chat, completions, embeddings: :mod:`serving.gateway.routes`)
are raw ASGI endpoints (they carry every token); the rest is FastAPI. The routes of the agent APIs
(Responses, Messages, tokenize) come from :mod:`serving.gateway.agent_routes` through the same
generate endpoint; the admin routes (promotion status, admin keys only) from
:mod:`serving.gateway.admin`.
"""

from __future__ import annotations

import logging

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from serving.errors import ErrorShape, GatewayError, InvalidRequest, MethodNotAllowed, NotFound, to_response
from serving.gateway.admin import AdminAccess, add_admin_routes
from serving.gateway.agent_routes import add_agent_routes
from serving.gateway.core import GatewayCore
from serving.gateway.routes import Generate, request_id, tenant_of

logger = logging.getLogger("serving.gateway")

__all__ = ["GatewayApp", "create_api"]

_JSON = "application/json"


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
        rid = request_id(request)
        shape: ErrorShape = "anthropic" if request.url.path.startswith("/v1/messages") else "openai"
        if exc.status_code == 405:
            return _error(MethodNotAllowed(f"Method {request.method} is not allowed here."), rid, shape)
        if exc.status_code == 404:
            return _error(NotFound(f"Unknown path {request.url.path}."), rid, shape)
        return _error(InvalidRequest(str(exc.detail)), rid, shape)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return _error(InvalidRequest(str(exc.errors()[:1])), request_id(request))

    generate = {
        "/v1/chat/completions": Generate(core, "chat", "/v1/chat/completions", rid_header, _error),
        "/v1/completions": Generate(core, "completion", "/v1/completions", rid_header, _error),
        "/v1/embeddings": Generate(core, "embedding", "/v1/embeddings", rid_header, _error),
    }
    generate |= add_agent_routes(app, core, rid_header, _error)
    core.admins = add_admin_routes(app, admin, lambda: core.auth, _error, request_id)
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
            return _error(exc, request_id(request))
        return Response(msgspec.json.encode({"object": "list", "data": data}), media_type=_JSON)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> Response:
        try:
            for i, card in _visible(request):
                if i == model_id:
                    return Response(msgspec.json.encode(card), media_type=_JSON)
        except GatewayError as exc:
            return _error(exc, request_id(request))
        return _error(
            NotFound(
                f"The model '{model_id}' does not exist or you do not have access to it.",
                param="model",
                code="model_not_found",
            ),
            request_id(request),
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
