"""The gateway as a Ray Serve ingress deployment; model replicas picked directly from their
published endpoints (:mod:`serving.gateway.replicas`) or leased through Serve deployment handles."""

from __future__ import annotations

import logging
from typing import Any

from ray import serve

from serving.config import GatewayConfig, ShutdownConfig
from serving.contract import RUNNING_REQUESTS_KEY
from serving.gateway.admin import AdminAccess
from serving.gateway.api import create_api
from serving.gateway.core import GatewayCore
from serving.gateway.replicas import ReplicaFinder

logger = logging.getLogger("serving.gateway")

__all__ = ["Gateway", "build_gateway"]


@serve.ingress()
class Gateway:
    """Ingress deployment. ``config`` and ``shutdown`` (the stack's ``GatewayConfig`` and
    ``ShutdownConfig`` as JSON) and ``admin`` (an :class:`AdminAccess`, only when the stack has
    an admin key) are the init args; the routing table is the ``user_config``, so
    promotions and weight changes are applied in place (``reconfigure``), with no restart.

    With ``gateway.ingress: listener`` (the default) the replica serves the OpenAI API on its
    address itself (:mod:`serving.gateway.listener`); Serve's proxy still serves the same app on
    its own port. Without it, Serve's proxy is the only way in (``ingress: serve_proxy``)."""

    def __init__(self, config: dict[str, Any], shutdown: dict[str, Any], admin: dict[str, Any] | None = None) -> None:
        from serving.metrics import GatewayMetrics

        cfg = GatewayConfig.model_validate(config)
        self.admin = AdminAccess.model_validate(admin) if admin else None
        stop = ShutdownConfig.model_validate(shutdown)
        replica = str(serve.get_replica_context().replica_tag)
        self.leases = ReplicaFinder(direct=cfg.replica_routing == "direct")
        # behind Serve's proxy, the proxy sets x-request-id; the listener sets it itself
        self.core = GatewayCore(
            cfg, self.leases, GatewayMetrics(), replica_id=replica, set_request_id_header=False, kv=self.leases.feeds
        )
        self._listener = None
        if cfg.ingress == "listener":
            from serving.gateway.listener import Listener

            app = create_api(self.core, set_request_id_header=True, admin=self.admin)
            self._listener = Listener(
                app,
                cfg.host,
                cfg.port,
                keep_alive_s=cfg.keep_alive_s,
                header_timeout_s=cfg.header_timeout_s,
                body_timeout_s=cfg.body_timeout_s,
                max_connections=cfg.max_client_connections,
                notice_s=stop.notice_s,
                drain_s=stop.listener_drain_s,
            )

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        self.core.reconfigure(user_config)
        self.leases.start()
        if self._listener is not None and not self._listener.started:
            await self._listener.start()  # only once a routing table exists

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Requests served by the listener, which Serve does not see, count as this replica's
        running requests, so ``gateway.autoscaling`` scales on the real load."""
        if self._listener is None:
            return {}  # Serve counts the requests its proxy brings
        return {RUNNING_REQUESTS_KEY: float(self._listener.in_flight)}

    async def __del__(self) -> None:
        """Serve stops this replica: fail readiness, give the load balancer ``notice_s``, close the
        listener and let its requests finish (:meth:`Listener.stop`); only then stop reading
        model endpoints and close the upstream clients the requests used."""
        if self._listener is not None:
            await self._listener.stop()
        self.leases.stop()
        await self.core.aclose()

    def __serve_build_asgi_app__(self) -> Any:
        return create_api(self.core, admin=self.admin)


def build_gateway(args: dict[str, Any]) -> Any:
    """Serve application builder (``import_path: serving.gateway.deployment:build_gateway``)."""
    return serve.deployment(name="Gateway")(Gateway).bind(args["config"], args["shutdown"], args.get("admin"))
