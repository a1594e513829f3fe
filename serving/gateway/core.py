"""Gateway core: the object graph behind the HTTP routes, built once per gateway replica.

It owns the routing table (from the Serve ``user_config``), one pooled HTTP client, and the
lease provider. Route handlers stay thin: parse, resolve, call :meth:`GatewayCore.complete`, render.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from serving.errors import Unavailable
from serving.gateway.proxy import Lease, UpstreamResult, forward
from serving.gateway.routing import Resolved, RoutingTable
from serving.models.server import LeaseHint
from serving.protocol import ParsedRequest

logger = logging.getLogger("serving.gateway")

__all__ = ["GatewayCore", "GatewaySettings", "LeaseProvider"]


@dataclass(frozen=True)
class GatewaySettings:
    max_body_bytes: int = 1_048_576
    retries: int = 2
    upstream_timeout_s: float = 600.0
    max_connections: int = 1024
    # Ray Serve's proxy already echoes x-request-id on responses; plain ASGI use needs it added.
    set_request_id_header: bool = True


class LeaseProvider(Protocol):
    async def lease(self, app: str, hint: LeaseHint, timeout_s: float) -> Lease: ...

    async def ready(self, app: str, timeout_s: float) -> bool: ...


class GatewayCore:
    def __init__(self, settings: GatewaySettings, leases: LeaseProvider) -> None:
        self.settings = settings
        self.leases = leases
        self.routes = RoutingTable()
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(settings.upstream_timeout_s, connect=5.0),
            limits=httpx.Limits(
                max_connections=settings.max_connections,
                max_keepalive_connections=settings.max_connections,
            ),
        )
        self._ready_cache: tuple[float, bool] = (0.0, False)

    def update_routes(self, user_config: dict[str, Any]) -> None:
        self.routes = RoutingTable.from_user_config(user_config)
        logger.info("routing table: %s", {m.name: [(v.version, v.weight) for v in m.versions]
                                          for m in self.routes.models.values()})  # fmt: skip

    def hint_for(self, resolved: Resolved, parsed: ParsedRequest, session_id: str | None) -> LeaseHint:
        router = resolved.model.router
        if router == "prefix_affinity":
            return LeaseHint(prompt=parsed.prompt_text())
        if router == "session_affinity":
            return LeaseHint(session_id=session_id)
        return LeaseHint()

    async def complete(
        self,
        parsed: ParsedRequest,
        resolved: Resolved,
        path: str,
        request_id: str,
        session_id: str | None = None,
        on_done: Callable[[bool], None] = lambda ok: None,
    ) -> UpstreamResult:
        hint = self.hint_for(resolved, parsed, session_id)
        app = resolved.version.app
        timeout = resolved.model.cold_start_timeout_s

        async def leaser() -> Lease:
            return await self.leases.lease(app, hint, timeout)

        return await forward(
            client=self.client,
            leaser=leaser,
            path=path,
            body=parsed.with_model(resolved.model.name),
            stream=parsed.stream,
            request_id=request_id,
            retries=self.settings.retries,
            on_done=on_done,
        )

    async def ready(self) -> bool:
        """Every live version of every model with a running replica (cached for 2 s)."""
        at, ok = self._ready_cache
        if time.monotonic() - at < 2.0:
            return ok
        apps = [v.app for m in self.routes.models.values() for v in m.versions if v.weight > 0]
        if not apps:
            ok = False
        else:
            results = await asyncio.gather(*(self.leases.ready(a, 5.0) for a in apps))
            ok = all(results)
        self._ready_cache = (time.monotonic(), ok)
        return ok

    async def aclose(self) -> None:
        await self.client.aclose()


def unavailable(message: str, retry_after: int = 1) -> Unavailable:
    return Unavailable(message, headers={"retry-after": str(retry_after)})
