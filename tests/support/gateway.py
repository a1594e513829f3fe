"""The gateway app in-process, with an in-process quota actor and response store, over given
replicas (``loadtests.relay.OneReplica`` or a subclass), for tests that look at admission and
settling."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx

from serving.config import GatewayConfig, parse_config
from serving.control.serve_config import routing_user_config
from serving.gateway.admission.quota import QuotaActor, QuotaClient
from serving.gateway.api import create_api
from serving.gateway.conversations import ResponseStoreActor
from serving.gateway.core import GatewayCore
from tests.support.actors import LocalActor
from tests.support.kv import MemoryKV

__all__ = ["quota_gateway"]


@contextlib.asynccontextmanager
async def quota_gateway(
    leases: Any, stack: dict[str, Any], **settings: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, GatewayCore, QuotaActor]]:
    """A client of the gateway serving ``stack`` (a stack config as a dict), its core and its
    quota actor (whose counts a test reads)."""
    actor = QuotaActor(MemoryKV(), checkpoint_s=0)
    responses = LocalActor(ResponseStoreActor(MemoryKV(), 0))
    core = GatewayCore(GatewayConfig(**settings), leases, response_store_actor=responses)
    core.quota = QuotaClient(60, LocalActor(actor))  # kept by reconfigure
    core.reconfigure(routing_user_config(parse_config(stack)))
    transport = httpx.ASGITransport(app=create_api(core))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=20) as c:
            yield c, core, actor
    finally:
        await core.aclose()
