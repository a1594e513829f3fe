"""``GET /admin/promotions`` and ``GET /admin/promotions/{model}``: the promotion controller's
state, read from its record in the checkpoint store (:mod:`serving.record`).

Why the gateway and the record: the gateway is the one HTTP surface a stack already exposes
(locally and behind the Kubernetes Service), and the record is what the controller writes before
every step, so the answer is the same whichever cluster or controller replica is active, and
it is there while the controller restarts. Nothing is asked of the controller itself.

Access is an admin key, never a tenant's: ``controller.admin_key_hashes`` (salted hashes, the
format of tenants' ``key_hashes``) or ``controller.admin_key_env``, checked by the same
:class:`~serving.gateway.admission.auth.Authenticator` as tenants' keys. A missing or unknown key
gets 401, a tenant's key 403. An admin key that is also a tenant's is refused when the gateway
starts or takes a new tenant list (:func:`~serving.gateway.admission.auth.check_admin_keys`). A
stack with no admin key has no admin routes: 404, as for any unknown path (``auth.mode: open``
does not open them). The store is read in a thread pool of its own
(fsspec calls block; a hung store holds its two threads, never the event loop or its default
executor), bounded by ``controller.admin_timeout_s``: then 503.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from serving.config import AuthConfig, TenantConfig
from serving.errors import AuthenticationError, GatewayError, NotFound, PermissionDenied, unavailable
from serving.gateway.admission.auth import Authenticator, check_admin_keys
from serving.record import ControlStore, PromotionRecord

logger = logging.getLogger("serving.gateway")

__all__ = ["AdminAccess", "PromotionStatus", "add_admin_routes"]

_JSON = "application/json"


class AdminAccess(BaseModel):
    """The gateway's ``admin`` init arg (built by ``build_serve_config`` from ``controller``):
    where the record is and which keys may read it (hashes and an env-var name, never a key)."""

    model_config = ConfigDict(extra="forbid")

    store_root: str
    stack: str
    key_hashes: list[str] = []
    key_env: str | None = None
    timeout_s: float = Field(5.0, gt=0)

    def authenticator(self) -> Authenticator:
        tenant = TenantConfig(name="admin", key_hashes=self.key_hashes, key_env=self.key_env)
        return Authenticator(AuthConfig(mode="keys", tenants=[tenant]))


def _summary(rec: PromotionRecord, steps: bool) -> dict[str, Any]:
    last = rec.steps[-1] if rec.steps else None
    out: dict[str, Any] = {
        "id": rec.id,
        "version": rec.version,
        "previous": rec.previous,
        "source": rec.source,
        "status": rec.status,
        "step_index": rec.step_index,
        "phase": last.phase if last else None,
        "weights": last.weights if last else {},
        "figures": last.figures if last else {},
        "reason": rec.reason,
        "created_at": rec.created_at,
        "updated_at": rec.updated_at,
    }
    if steps:
        out["steps"] = [s.model_dump() for s in rec.steps]
    return out


class PromotionStatus:
    """What the admin routes answer, read from the record (blocking calls: run in a thread)."""

    def __init__(self, store: ControlStore) -> None:
        self.store = store

    def model(self, name: str, last: int, steps: bool) -> dict[str, Any] | None:
        """``name``'s live versions, its active promotion and its ``last`` promotions (newest
        first); None if the record knows nothing of it."""
        live = self.store.live().get(name)
        history = self.store.history(name)
        if live is None and not history:
            return None
        active = next((r for r in reversed(history) if r.active), None)
        return {
            "object": "promotion.status",
            "model": name,
            "live": [v.model_dump(exclude_none=True) for v in live or []],
            "active": _summary(active, steps=False) if active else None,
            "history": [_summary(r, steps) for r in reversed(history[-last:])],
        }

    def all(self, last: int) -> dict[str, Any]:
        names = sorted(set(self.store.live()) | set(self.store.models_with_history()))
        data = [s for s in (self.model(n, last, steps=False) for n in names) if s is not None]
        return {"object": "list", "data": data}


def _is_tenant(tenants: Authenticator, authorization: str | None, api_key: str | None) -> bool:
    if tenants.open:
        return False
    try:
        tenants.authenticate(authorization, api_key)
    except AuthenticationError:
        return False
    return True


def add_admin_routes(
    app: FastAPI,
    access: AdminAccess | None,
    tenants: Callable[[], Authenticator],
    error: Callable[[BaseException, str], Response],
    request_id: Callable[[Request], str],
) -> Authenticator | None:
    """Add the admin routes to ``app``; returns their keys (None: no admin key), which the gateway
    checks again against each new tenant list. ``tenants`` gives the gateway's current tenant keys
    (to tell a tenant's key, 403, from an unknown one, 401); raises ValueError if an admin key is
    one of them."""
    admins = access.authenticator() if access else None
    if admins is not None:
        check_admin_keys(admins, tenants())
    # its own threads: a store that hangs holds these two, never the loop's default executor
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="admin-record")
    status = PromotionStatus(ControlStore(access.store_root, access.stack)) if access else None

    def _admit(request: Request) -> PromotionStatus:
        if admins is None or status is None:
            raise NotFound(f"Unknown path {request.url.path}.")
        auth, key = request.headers.get("authorization"), request.headers.get("x-api-key")
        try:
            admins.authenticate(auth, key)
        except AuthenticationError:
            if (auth or key) and _is_tenant(tenants(), auth, key):
                raise PermissionDenied("This route needs an admin key; a tenant's key cannot read it.") from None
            raise
        return status

    async def _read(fn: Callable[[], dict[str, Any] | None]) -> dict[str, Any] | None:
        assert access is not None
        try:
            work = asyncio.get_running_loop().run_in_executor(pool, fn)
            return await asyncio.wait_for(work, access.timeout_s)
        except TimeoutError:
            raise unavailable(f"The promotion record did not answer within {access.timeout_s:g} s.") from None
        except (OSError, ValueError) as exc:  # an unreachable store, or a file that does not parse
            logger.warning("admin: reading the promotion record failed: %s", type(exc).__name__)
            raise unavailable("The promotion record cannot be read now.") from None

    @app.get("/admin/promotions")
    async def promotions(request: Request, last: int = 1) -> Response:
        try:
            found = _admit(request)
            body = await _read(lambda: found.all(max(1, min(last, 100))))
        except GatewayError as exc:
            return error(exc, request_id(request))
        return Response(msgspec.json.encode(body), media_type=_JSON)

    @app.get("/admin/promotions/{model}")
    async def promotion(model: str, request: Request, last: int = 10) -> Response:
        try:
            found = _admit(request)
            body = await _read(lambda: found.model(model, max(1, min(last, 100)), steps=True))
            if body is None:
                raise NotFound(f"The promotion record has no model '{model}'.", param="model", code="model_not_found")
        except GatewayError as exc:
            return error(exc, request_id(request))
        return Response(msgspec.json.encode(body), media_type=_JSON)

    return admins
