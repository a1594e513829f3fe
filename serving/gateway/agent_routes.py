"""The routes agent clients use, over the same :class:`serving.gateway.routes.Generate` endpoint
as chat (so auth, tenant model lists, RPM/TPM, shedding, retries, failover and metrics are chat's):

- ``POST /v1/responses`` (OpenAI's Responses API, streamed or not), with conversation state the
  gateway owns (:class:`ResponsesFlow`, :mod:`serving.gateway.conversations`);
  ``GET``/``DELETE /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel`` are answered from
  that store, never from (or retried onto) a model replica;
- ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (Anthropic's Messages API, errors
  in Anthropic's shape);
- ``POST /tokenize`` and ``POST /detokenize`` (vLLM's, per model: the body names it).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response

from serving.errors import ErrorShape, GatewayError, InvalidRequest, NotFound
from serving.gateway.admission.auth import Tenant
from serving.gateway.agent_protocol import AgentKind, AgentRequest, parse_agent_request
from serving.gateway.conversations import ResponseStore, expand
from serving.gateway.core import GatewayCore
from serving.gateway.relay import UpstreamResult
from serving.gateway.routes import ErrorRenderer, Generate, request_id, tenant_of

logger = logging.getLogger("serving.gateway")

__all__ = ["ROUTES", "ResponsesFlow", "Turn", "add_agent_routes"]

_JSON = "application/json"
_FINAL = (b"event: response.completed", b"event: response.incomplete", b"event: response.failed")
ROUTES: dict[str, AgentKind] = {
    "/v1/responses": "responses",
    "/v1/messages": "messages",
    "/v1/messages/count_tokens": "count_tokens",
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
}


@dataclass(frozen=True)
class Turn:
    """One Responses request's conversation: the input items it sent (history included), the
    response it followed and whether its answer is to be stored."""

    items: list[Any]
    previous_id: str | None
    store: bool


# events whose data carries the whole response object
_LIFECYCLE = (b"event: response.created\n", b"event: response.in_progress\n", *(f + b"\n" for f in _FINAL))


def restate(chunk: bytes, previous_id: str | None, store: bool) -> bytes:
    """``chunk`` (whole events) with the client's ``previous_response_id`` and ``store`` in every
    response object it carries: the engine was sent the expanded input with ``store: false``."""
    if b"event: response." not in chunk:
        return chunk
    events = chunk.split(b"\n\n")
    for i, ev in enumerate(events):
        if not ev.startswith(_LIFECYCLE):
            continue
        head, sep, data = ev.partition(b"\ndata: ")
        try:
            obj = msgspec.json.decode(data)
        except msgspec.DecodeError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("response"), dict):
            obj["response"] |= {"previous_response_id": previous_id, "store": store}
            events[i] = head + sep + msgspec.json.encode(obj)
    return b"\n\n".join(events)


def _final_response(chunk: bytes) -> dict[str, Any] | None:
    """The response object of a Responses stream's final event, if ``chunk`` holds it."""
    for ev in chunk.split(b"\n\n"):
        if ev.startswith(_FINAL):
            _, _, data = ev.partition(b"\ndata: ")
            try:
                response = msgspec.json.decode(data).get("response")
            except (msgspec.DecodeError, AttributeError):
                return None
            return response if isinstance(response, dict) else None
    return None


class ResponsesFlow:
    """Conversation state around ``POST /v1/responses``: a ``previous_response_id`` is expanded
    from the tenant's store into input items; a ``store: true`` answer (OpenAI's default) is
    written to the store before its last byte reaches the client, so a follow-up sent as soon
    as the answer arrives finds it, whichever gateway replica it reaches."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    async def prepare(self, parsed: AgentRequest, tenant: Tenant) -> tuple[AgentRequest, Turn]:
        prev_id = parsed.body.get("previous_response_id")
        previous = await self.store.get(tenant.name, prev_id) if prev_id else None
        if prev_id and previous is None:
            raise NotFound(
                f"Previous response with id '{prev_id}' not found.",
                param="previous_response_id",
                code="response_not_found",
            )
        body, items = expand(parsed.body, previous)
        turn = Turn(items, prev_id, parsed.body.get("store", True) is not False)
        return parsed.with_body(body), turn

    def _stored(self, response: dict[str, Any], turn: Turn) -> dict[str, Any]:
        return {**response, "previous_response_id": turn.previous_id, "store": turn.store}

    async def _save(self, response: dict[str, Any], turn: Turn, tenant: Tenant) -> bool:
        """Whether the response is stored now (it is not when the client said ``store: false``,
        it is over ``max_response_bytes``, or the store failed)."""
        rid = response.get("id")
        if turn.store and isinstance(rid, str):
            items = turn.items + list(response.get("output") or [])
            return await self.store.put(tenant.name, rid, {"response": response, "items": items})
        return False

    async def finish(self, result: UpstreamResult, turn: Turn, tenant: Tenant) -> UpstreamResult:
        if result.stream is None:
            if result.status != 200 or not result.body:
                return result
            response = self._stored(msgspec.json.decode(result.body), turn)
            response["store"] = await self._save(response, turn, tenant)  # what the client may follow up on
            result.body = msgspec.json.encode(response)
            return result
        result.stream = self._storing(result.stream, turn, tenant)
        return result

    async def _storing(self, stream: Any, turn: Turn, tenant: Tenant) -> Any:
        """The stream, restated; the final event says whether its response was really stored."""
        saved = False
        try:
            async for raw in stream:
                stored = turn.store
                if not saved and b"event: response." in raw:
                    response = _final_response(raw)
                    if response is not None:
                        saved = True
                        stored = await self._save(self._stored(response, turn), turn, tenant)
                yield restate(raw, turn.previous_id, stored)
        finally:
            await stream.aclose()


def _stored_routes(app: FastAPI, core: GatewayCore, store: ResponseStore, error: ErrorRenderer) -> None:
    """Retrieve, delete and cancel, from the store (counted against the tenant's RPM)."""

    async def _find(request: Request, response_id: str) -> tuple[Tenant, dict[str, Any]]:
        tenant = tenant_of(core, request)
        await core.quota.admit(tenant.name, tenant.rpm, None)
        record = await store.get(tenant.name, response_id)
        if record is None:
            raise NotFound(
                f"Response with id '{response_id}' not found.", param="response_id", code="response_not_found"
            )
        return tenant, record

    def _json(value: Any) -> Response:
        headers = {"x-gateway-replica": core.replica_id} if core.settings.expose_replica_header else None
        return Response(msgspec.json.encode(value), headers=headers, media_type=_JSON)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: Request) -> Response:
        try:
            _, record = await _find(request, response_id)
        except GatewayError as exc:
            return error(exc, request_id(request), "openai")
        return _json(record["response"])

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, request: Request) -> Response:
        try:
            tenant, _ = await _find(request, response_id)
            await store.delete(tenant.name, response_id)
        except GatewayError as exc:
            return error(exc, request_id(request), "openai")
        return _json({"id": response_id, "object": "response", "deleted": True})

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str, request: Request) -> Response:
        """Only background responses can be cancelled, and this gateway runs none: a stored
        response is finished, so cancelling it is a 400 (vLLM's answer too), an unknown id a 404."""
        try:
            await _find(request, response_id)
            raise InvalidRequest("Cannot cancel a synchronous response.", param="response_id")
        except GatewayError as exc:
            return error(exc, request_id(request), "openai")


def _renderer(error: ErrorRenderer, shape: ErrorShape) -> Callable[[BaseException, str], Response]:
    def render(exc: BaseException, rid: str) -> Response:
        return error(exc, rid, shape)

    return render


def add_agent_routes(app: FastAPI, core: GatewayCore, rid_header: bool, error: ErrorRenderer) -> dict[str, Generate]:
    """Add the retrieval routes to ``app``; returns the generate endpoints by path (the caller
    mounts them, as it does chat's)."""
    store = ResponseStore(core.settings.responses, metrics=core.metrics, actor=core.response_store_actor)
    flow = ResponsesFlow(store)
    _stored_routes(app, core, store, error)
    out: dict[str, Generate] = {}
    for path, kind in ROUTES.items():
        parse = functools.partial(parse_agent_request, kind=kind)
        shape: ErrorShape = "anthropic" if kind in ("messages", "count_tokens") else "openai"
        render = _renderer(error, shape)
        out[path] = Generate(core, kind, path, rid_header, render, parse, flow if kind == "responses" else None)
    return out
