"""ASGI middleware that vLLM's OpenAI server loads (``--middleware
serving.replica.engine_guard.RequireToken``): the replica's token on every route but ``/health``.

Why: vLLM's own ``--api-key`` check guards only the ``/v1``, ``/v2``, ``/inference`` and
``/cohere`` prefixes; ``/invocations``, ``/tokenize``, ``/metrics`` and the rest answer anyone
who reaches the engine port, which listens on the node's address. The token comes from the
environment (``VLLM_API_KEY``, the variable vLLM reads its own key from), never from the command
line, where every local user could read it in ``ps``. Imports nothing from vLLM.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Any

__all__ = ["OPEN_PATHS", "TOKEN_ENV", "RequireToken"]

TOKEN_ENV = "VLLM_API_KEY"
OPEN_PATHS = frozenset({"/health"})  # Serve's health check and the replica's readiness wait

_UNAUTHORIZED = (
    b'{"error":{"message":"Missing or wrong engine token.","type":"authentication_error",'
    b'"param":null,"code":"invalid_api_key"}}'
)


class RequireToken:
    """Answers 401 to any HTTP or WebSocket request without ``Authorization: Bearer <token>``,
    except ``OPEN_PATHS``. With no token in the environment every request is refused: an engine
    started without one must not serve."""

    def __init__(self, app: Any) -> None:
        self.app = app
        token = os.environ.get(TOKEN_ENV, "")
        self._digest = hashlib.sha256(token.encode()).digest() if token else None

    def _allowed(self, scope: dict[str, Any]) -> bool:
        if self._digest is None:
            return False
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, given = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(
                    hashlib.sha256(given.encode()).digest(), self._digest
                )
        return False

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in OPEN_PATHS or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")],
            }
        )
        await send({"type": "http.response.body", "body": _UNAUTHORIZED})
