"""The gateway as a Ray Serve ingress deployment; model replicas picked directly from their
published endpoints (:mod:`serving.endpoints`) or leased through Serve deployment handles."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from serving.endpoints import KV, EndpointTable, RayKV
from serving.gateway.api import create_api
from serving.gateway.core import GatewayCore, GatewaySettings, unavailable
from serving.gateway.proxy import Lease, ReplicaGone
from serving.models.server import RUNNING_REQUESTS_KEY, Endpoint, LeaseHint

logger = logging.getLogger("serving.gateway")

__all__ = ["Gateway", "ServeLeases"]


def _cancel(gen: DeploymentResponseGenerator) -> None:
    """End a lease call; a call that already failed (its replica died) has nothing to end."""
    try:
        gen.cancel()
    except Exception:  # noqa: BLE001 - the call's own error was handled where it surfaced
        pass


class _ServeLease:
    """A leased replica. The lease call stays open while the request runs; if the replica dies,
    Ray fails that call at once and ``died`` is set, so the gateway stops waiting on its sockets."""

    __slots__ = ("_gen", "_watcher", "died", "replica", "token", "url")
    route = "serve"

    def __init__(self, gen: DeploymentResponseGenerator, endpoint: Endpoint) -> None:
        self._gen = gen
        self.url = endpoint.url
        self.token = endpoint.token
        self.replica = endpoint.replica
        self.died = asyncio.Event()
        self._watcher = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        try:
            await self._gen.__anext__()  # the replica yields nothing more; this only fails
        except (ActorDiedError, ActorUnavailableError, RayActorError):
            logger.warning("replica %s died during a request", self.replica)
            self.died.set()
        except BaseException:  # noqa: BLE001 - cancelled by release(), or the lease ended
            return

    def release(self, failed: bool = False) -> None:
        self._watcher.cancel()
        _cancel(self._gen)


class ServeLeases:
    """Finds a model replica for each request. With ``direct``, requests that need no routing
    hint (power of two choices) go to a replica this gateway picks from the published endpoints,
    with no Ray call; the others, and any request for an app with no known endpoint (cold, scaled
    to zero) or whose picked replicas are at ``limit``, lease through Serve's handle and router."""

    def __init__(self, direct: bool = False, kv: KV | None = None) -> None:
        self._handles: dict[str, DeploymentHandle] = {}
        self.table = EndpointTable() if direct else None
        self._kv = kv
        self._refresher: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start reading endpoints (in the replica's event loop; ``Gateway.reconfigure`` calls it
        before the first request, as Serve applies the user_config before serving)."""
        if self.table is not None and self._refresher is None:
            self._refresher = asyncio.ensure_future(self.table.refresh_forever(self._kv or RayKV()))

    def stop(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()

    def _handle(self, app: str) -> DeploymentHandle:
        h = self._handles.get(app)
        if h is None:
            h = serve.get_deployment_handle(app, app_name=app).options(stream=True)
            self._handles[app] = h
        return h

    async def lease(self, app: str, hint: LeaseHint, timeout_s: float, limit: int = 0) -> Lease:
        if self.table is not None and hint.prompt is None and hint.session_id is None:
            picked = self.table.pick(app, limit)
            if picked is not None:
                return picked
        gen = self._handle(app).lease.remote(hint)
        try:
            endpoint = await asyncio.wait_for(gen.__anext__(), timeout_s)
        except BackPressureError:
            raise unavailable(f"Model '{app}' is at capacity; retry shortly.", 1) from None
        except TimeoutError:
            _cancel(gen)  # still waiting for a replica: withdraw the request
            raise unavailable(f"No replica of '{app}' became available in {timeout_s:.0f}s.", 5) from None
        except (ActorDiedError, ActorUnavailableError, RayActorError, StopAsyncIteration) as exc:
            raise ReplicaGone(f"replica unavailable: {type(exc).__name__}") from None
        except DeploymentUnavailableError:
            raise unavailable(f"Model '{app}' is not deployed right now.", 5) from None
        except RuntimeError as exc:  # the replica refused (its engine process is down)
            raise ReplicaGone(f"replica refused lease: {exc}") from None
        return _ServeLease(gen, endpoint)

    async def ready(self, app: str, timeout_s: float) -> bool:
        try:
            h = serve.get_deployment_handle(app, app_name=app)
            return bool(await asyncio.wait_for(h.ready.remote(), timeout_s))
        except Exception:
            return False


@serve.ingress()
class Gateway:
    """Ingress deployment. ``settings`` are init args; the routing table is the ``user_config``
    so promotions and weight changes are applied in place (``reconfigure``), with no restart.

    With ``listen`` (``gateway.ingress: direct``, the default) the replica serves the OpenAI API on
    that address itself (:mod:`serving.gateway.direct`); Serve's proxy still serves the same app on
    its own port. Without it, Serve's proxy is the only way in (``ingress: serve_proxy``)."""

    def __init__(self, settings: dict[str, Any], listen: dict[str, Any] | None = None) -> None:
        from serving.metrics import GatewayMetrics

        replica = str(serve.get_replica_context().replica_tag)
        settings = {
            **settings,
            "set_request_id_header": False,
            "replica_id": replica,
        }  # Serve's proxy sets x-request-id
        gs = GatewaySettings(**settings)
        self.leases = ServeLeases(direct=gs.replica_routing == "direct")
        self.core = GatewayCore(gs, self.leases, GatewayMetrics())
        self._listener = None
        if listen:
            from serving.gateway.direct import DirectListener

            app = create_api(self.core, set_request_id_header=True)
            self._listener = DirectListener(
                app,
                listen["host"],
                int(listen["port"]),
                drain_s=float(listen.get("drain_s", 30)),
                notice_s=float(listen.get("notice_s", 0)),
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
        listener and let its requests finish (:meth:`DirectListener.stop`); only then stop reading
        model endpoints and close the upstream clients the requests used."""
        if self._listener is not None:
            await self._listener.stop()
        self.leases.stop()
        await self.core.aclose()

    def __serve_build_asgi_app__(self) -> Any:
        return create_api(self.core)
