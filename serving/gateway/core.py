"""Gateway core: the object graph behind the HTTP routes, built once per gateway replica.

It owns the routing table and tenants (from the Serve ``user_config``, so both change in place),
one pooled HTTP client, the replica finder (direct picks or Serve leases), quotas and metrics.
Route handlers stay thin: parse, authenticate, resolve, call :meth:`GatewayCore.complete`, render.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any

from serving.config import AuthConfig, GatewayConfig
from serving.contract import LeaseHint
from serving.errors import InvalidRequest, NotFound, RateLimited, unavailable
from serving.gateway.admission.auth import Authenticator, Tenant, check_admin_keys, tenant_cache_salt
from serving.gateway.admission.quota import QuotaClient
from serving.gateway.exchange import Exchange, count_refused, counted
from serving.gateway.kv_index import KVFeeds
from serving.gateway.migration import Plan, blocker
from serving.gateway.protocol import Forwardable, ParsedRequest
from serving.gateway.relay import Leaser, Observer, RetryBudget, Upstream, UpstreamResult, forward
from serving.gateway.replicas import Lease, LeaseProvider
from serving.gateway.routing import GatewayRoutes, Resolved, RoutingTable
from serving.gateway.splice import Splice, spliced

logger = logging.getLogger("serving.gateway")

__all__ = ["NO_PROMPT", "Exchange", "GatewayCore"]

# tokenize and detokenize need only a model's tokenizer, which a pooling model has too
TOKENIZER_KINDS = frozenset({"tokenize", "detokenize"})
KV_INLINE_BYTES = 32_768  # router kv_aware: a larger body is tokenized off the event loop
NO_PROMPT = "\x00"  # the prefix-affinity hint of a request with no leading text


class GatewayCore:
    def __init__(
        self,
        settings: GatewayConfig,
        leases: LeaseProvider,
        metrics: Any = None,
        replica_id: str = "",
        set_request_id_header: bool = True,
        response_store_actor: Any = None,
        kv: KVFeeds | None = None,
    ) -> None:
        self.settings = settings
        self.kv = kv  # router kv_aware: the engines' cached blocks and the apps' tokenizers
        # the shared store of Responses (serving.gateway.conversations); made on first use when None
        self.response_store_actor = response_store_actor
        self.replica_id = replica_id  # named in x-gateway-replica when expose_replica_header is on
        # Ray Serve's proxy already echoes x-request-id on responses; plain ASGI use needs it added
        self.set_request_id_header = set_request_id_header
        self.leases = leases
        self.metrics = metrics
        self.routes = RoutingTable()
        self.auth = Authenticator(AuthConfig(mode="open"))  # replaced by the first reconfigure
        self.admins: Authenticator | None = None  # the admin routes' keys (set by create_api), no tenant's
        self.quota = QuotaClient(60.0)
        self.in_flight: Counter[str] = Counter()
        self.client = Upstream(
            settings.max_upstream_connections, settings.upstream_timeout_s, pool_wait_s=settings.upstream_pool_wait_s
        )
        self.retry_budget = RetryBudget(settings.retry_budget_ratio, settings.retry_budget_min)
        self._ready_cache: tuple[float, bool] = (0.0, False)

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Apply the Serve ``user_config`` (a :class:`GatewayRoutes` as JSON) in place."""
        routes = GatewayRoutes.model_validate(user_config)
        auth = Authenticator(routes.auth)  # raises on a key of two tenants
        if self.admins is not None:
            check_admin_keys(self.admins, auth)
        self.routes = RoutingTable.from_routes(routes)
        self.auth = auth
        self.quota = QuotaClient(
            routes.auth.window_s,
            self.quota.actor,
            timeout_s=routes.auth.quota_timeout_s,
            failure_mode=routes.auth.quota_failure_mode,
        )
        logger.info(
            "routing table: %s",
            {m.name: [(v.version, v.weight) for v in m.versions] for m in self.routes.models.values()},
        )

    def authorize(self, tenant: Tenant, requested: str | None) -> Resolved:
        """Resolve the model for this tenant; a model it may not use looks like no model."""
        resolved = self.routes.resolve(requested)
        if not tenant.allows(resolved.model.name):
            raise NotFound(
                f"The model '{requested}' does not exist or you do not have access to it.",
                param="model",
                code="model_not_found",
            )
        return resolved

    @staticmethod
    def check_runner(parsed: Forwardable, resolved: Resolved, path: str) -> None:
        """A pooling model answers embeddings only, a generating model everything else: a
        request of the other kind is refused here (400), from the config, before any quota or
        engine is touched."""
        model = resolved.model
        if parsed.kind in TOKENIZER_KINDS or (model.runner == "pooling") == (parsed.kind == "embedding"):
            return
        if parsed.kind == "embedding":
            message = f"The model '{model.name}' does not support embeddings: it is not an embedding model."
        else:
            message = f"The model '{model.name}' is an embedding model: it answers /v1/embeddings only, not {path}."
        raise InvalidRequest(message, param="model", code="model_not_supported")

    def hint_for(self, resolved: Resolved, parsed: Forwardable, session_id: str | None) -> LeaseHint:
        router = resolved.model.router
        adapter = resolved.version.adapter
        blocks = None
        if router == "kv_aware" and self.kv is not None:
            blocks = self.kv.keys(resolved.version.app, parsed.kind, parsed.body, adapter)
        if adapter is not None:  # the base replicas that hold the adapter come first
            return LeaseHint(adapter=adapter, blocks=blocks)
        if blocks is not None:
            return LeaseHint(blocks=blocks)
        if router == "prefix_affinity":
            # ray.serve.llm's prefix router divides by the prompt's length and fails on None: a
            # request without leading text (content parts, /detokenize) would never be routed
            return LeaseHint(prompt=parsed.prompt_text() or NO_PROMPT)
        if router == "session_affinity":
            return LeaseHint(session_id=session_id)
        return LeaseHint()

    def _shed(self, model: str, tenant: Tenant) -> None:
        limit = self.routes.models[model].shed_low_priority_at
        if limit and tenant.priority < 5 and self.in_flight[model] >= limit:
            if self.metrics:
                self.metrics.shed.inc(tags={"model": model, "tenant": tenant.name})
            exc = unavailable(f"Model '{model}' is busy; low-priority requests are shed. Retry shortly.")
            counted(exc)  # in raystack_shed, not as refused
            raise exc

    def refused(self, exc: BaseException, tenant: Tenant | None) -> None:
        """Count a request answered with ``exc`` before an exchange counted it
        (:func:`serving.gateway.exchange.count_refused`)."""
        count_refused(self.metrics, exc, tenant)

    async def complete(
        self,
        parsed: Forwardable,
        resolved: Resolved,
        tenant: Tenant,
        path: str,
        request_id: str,
        session_id: str | None = None,
        arrived: float | None = None,
    ) -> tuple[UpstreamResult, dict[str, str]]:
        """Admit (shedding, then quota), forward with failover; returns the result and extra headers.
        ``arrived``: when the route got the request (``time.monotonic()``), where TTFT and latency
        start. An exception raised once a metric counted the request is marked
        (:func:`serving.gateway.exchange.counted`); any other is the route's to count as refused."""
        self.check_runner(parsed, resolved, path)
        parsed = self._salted(parsed, tenant)
        if parsed.n > self.settings.max_n:
            raise InvalidRequest(f"'n' must be at most {self.settings.max_n}, got {parsed.n}", param="n")
        model = resolved.model.name
        self._shed(model, tenant)  # before the quota: a shed request costs the tenant no RPM
        tpm = tenant.tpm if parsed.bills_tokens else None  # tokenize & co. count as requests only
        reserve = parsed.reserve_tokens(resolved.model.max_model_len) if tpm is not None else (0, 0)
        try:
            limit_headers, ticket = await self.quota.admit(
                tenant.name, tenant.rpm, tpm, sum(reserve), parsed.stream, tenant.max_streams
            )
        except RateLimited as exc:
            if self.metrics:
                self.metrics.rate_limited.inc(tags={"tenant": tenant.name, "limit": str(exc.code)})
            counted(exc)
            raise
        exchange: Exchange | None = None
        try:  # whatever fails from here on settles the ticket, and the exchange once there is one
            if resolved.model.router == "kv_aware" and len(parsed.raw) > KV_INLINE_BYTES:
                # tokenizing a long prompt takes a while (1 MB: ~0.8 s); every stream waits if it
                # runs on the event loop
                hint = await asyncio.to_thread(self.hint_for, resolved, parsed, session_id)
            else:
                hint = self.hint_for(resolved, parsed, session_id)
            app, timeout = resolved.version.app, resolved.model.cold_start_timeout_s
            limit = resolved.model.max_ongoing_requests
            loaded_first = resolved.model.adapter_routing == "loaded_first"
            served = resolved.version.served_name or model
            exchange = current = Exchange(
                parsed,
                resolved,
                tenant,
                in_flight=self.in_flight,
                quota=self.quota,
                metrics=self.metrics,
                ticket=ticket,
                reserved=reserve,
                arrived=arrived,
            )

            async def leaser() -> Lease:
                lease = await self.leases.lease(app, hint, timeout, limit, loaded_first)
                current.engine_asked = True  # from here an engine may run it: a client that leaves pays
                return lease

            # chat and completions streams may be continued elsewhere (serving.gateway.migration)
            splice = (
                self._splice(parsed, resolved, exchange, path, request_id, leaser)
                if isinstance(parsed, ParsedRequest)
                else None
            )
            result = await forward(
                client=self.client,
                leaser=leaser,
                path=path,
                body=splice.plan.original if splice else parsed.upstream_body(served),
                stream=parsed.stream,
                request_id=request_id,
                retries=self.settings.retries,
                obs=splice or exchange,
                budget=self.retry_budget,
                first_byte_s=self.settings.first_byte_timeout_s,
                shape=parsed.error_shape,
            )
        except BaseException as exc:  # a client that left cancels the request: 499
            if exchange is None:  # refused before an exchange began: nothing was asked of an engine
                self.quota.record(tenant.name, 0, ticket)
            else:
                exchange.finish(499 if isinstance(exc, asyncio.CancelledError) else getattr(exc, "status", 500))
                counted(exc)
            raise
        if splice is not None and result.stream is not None:
            result = spliced(result, splice)
        return result, limit_headers

    def _salted(self, parsed: Forwardable, tenant: Tenant) -> Forwardable:
        """The request with the ``cache_salt`` its tenant's prefix-cache scope gives it: under
        ``prefix_cache_scope: tenant`` one derived from the tenant's name and the client's own
        salt, so the engines never reuse one tenant's cached blocks for another's request (a
        shorter time to first token would tell that the prompt was sent before); under
        ``shared`` the client's salt as sent."""
        client = parsed.body.get("cache_salt")
        if client is not None and (not isinstance(client, str) or not client):
            raise InvalidRequest("'cache_salt' must be a non-empty string", param="cache_salt")
        if self.settings.prefix_cache_scope == "shared":
            return parsed
        return parsed.salted(tenant_cache_salt(tenant.name, client))

    def _splice(
        self, parsed: ParsedRequest, resolved: Resolved, exchange: Exchange, path: str, rid: str, leaser: Leaser
    ) -> Splice | None:
        """A splice for a stream that may be continued on another replica (None: it may not). Its
        later legs lease through ``leaser``, the request's own: the same version's replicas."""
        if self.settings.max_migrations < 1 or blocker(parsed) is not None:
            return None
        tags = {"model": resolved.model.name, "version": resolved.version.version}
        metrics = self.metrics

        async def resume(leg_path: str, body: bytes, obs: Observer) -> UpstreamResult:
            return await forward(
                client=self.client,
                leaser=leaser,
                path=leg_path,
                body=body,
                stream=True,
                request_id=rid,
                retries=self.settings.retries,
                obs=obs,
                first_byte_s=self.settings.first_byte_timeout_s,
            )

        def count(outcome: str) -> None:
            if metrics:
                metrics.migrations.inc(tags={**tags, "outcome": outcome})

        served = resolved.version.served_name or resolved.model.name
        plan = Plan.of(parsed, path, served, resolved.model.max_model_len)
        return Splice(
            exchange,
            plan,
            resume,
            rid,
            max_migrations=self.settings.max_migrations,
            allow=self.retry_budget.try_retry,
            count=count,
        )

    async def ready(self) -> bool:
        """Every live version of every model with a running replica (cached for 2 s)."""

        at, ok = self._ready_cache
        if time.monotonic() - at < 2.0:
            return ok
        apps = [v.app for m in self.routes.models.values() if not m.scale_to_zero for v in m.versions if v.weight > 0]
        ok = bool(apps) and all(await asyncio.gather(*(self.leases.ready(a, 5.0) for a in apps)))
        self._ready_cache = (time.monotonic(), ok)
        return ok

    async def aclose(self) -> None:
        await self.client.aclose()
