"""A model replica's HTTP side on loopback, for tests that drive the gateway's relay for real."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

__all__ = ["http_replica"]


@contextlib.asynccontextmanager
async def http_replica(handler: Any, health: Any = None, path: str = "/v1/completions") -> AsyncIterator[str]:
    """A real HTTP server on 127.0.0.1 answering POST ``path`` with ``handler`` and
    GET /health with ``health`` (default: 200, a healthy engine); yields its base URL."""

    async def healthy(request: web.Request) -> web.Response:
        return web.Response(status=200)

    app = web.Application()
    app.router.add_post(path, handler)
    app.router.add_get("/health", health or healthy)
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()
