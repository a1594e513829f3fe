"""The gateway labels each request's metrics with how its version was chosen: ``split`` when the
model's traffic split drew it, ``pinned`` when the client named ``model@version``; the promotion
controller judges a canary on split traffic only (tests/unit/test_promotion.py)."""

from __future__ import annotations

from typing import Any

import httpx
from aiohttp import web

from loadtests.relay import OneReplica
from serving.config import GatewayConfig, parse_config
from serving.control.serve_config import routing_user_config
from serving.gateway.api import create_api
from serving.gateway.core import GatewayCore
from serving.metrics import GatewayMetrics
from tests.support.loopback import http_replica

STACK = {
    "auth": {"mode": "open"},
    "models": [
        {
            "name": "m",
            "engine": {"max_model_len": 64},
            "versions": [{"version": "v1", "weight": 100}, {"version": "v2", "weight": 0}],
        }
    ],
}


class Recorded:
    """Ray's metrics need a cluster: the tags of every request counted, through the real ``tags``."""

    def __init__(self) -> None:
        self.counted: list[dict[str, str]] = []

    def tags(self, *args: Any) -> dict[str, str]:
        return GatewayMetrics.tags(None, *args)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        seen = self.counted

        class Metric:
            def inc(self, value: float = 1, tags: dict[str, str] | None = None) -> None:
                if name == "requests":
                    seen.append(tags or {})

            def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
                pass

            def set(self, value: float, tags: dict[str, str] | None = None) -> None:
                pass

        return Metric()


async def test_requests_that_name_a_version_are_counted_as_pinned() -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.json_response({"id": "c", "object": "text_completion", "choices": [], "usage": {}})

    async with http_replica(handler) as url:
        core = GatewayCore(GatewayConfig(), OneReplica(url))
        core.reconfigure(routing_user_config(parse_config(STACK)))
        core.metrics = Recorded()
        transport = httpx.ASGITransport(app=create_api(core))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
                for model in ("m", "m@v2", "m@v1"):
                    r = await c.post("/v1/completions", json={"model": model, "prompt": "1", "max_tokens": 1})
                    assert r.status_code == 200, r.text
        finally:
            await core.aclose()
    got = [(t["version"], t["routed"]) for t in core.metrics.counted]
    assert got == [("v1", "split"), ("v2", "pinned"), ("v1", "pinned")]
