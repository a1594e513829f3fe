"""The gateway's own HTTP listener: the OpenAI API served by each gateway replica directly.

Why (docs/performance.md, "Where the time goes"): behind Ray Serve's HTTP proxy every
streamed chunk travels proxy <-> replica as a Ray streaming-generator item, and on a 2-core machine
that per-token work competes with the engine. Here each gateway replica runs uvicorn (the same
FastAPI app) on the gateway port itself, on the replica's event loop, so a token crosses one Python
process between vLLM and the client. All replicas on a node bind the same port with
``SO_REUSEPORT`` and the kernel spreads connections over them; Serve's proxy stays up on an
internal port for its own health checks.

Stopping is ordered (:meth:`Listener.stop`): first the readiness paths (``/-/healthz``,
the path KubeRay's probe asks, and ``/ready``) answer 503 and every response carries
``connection: close``, so a load balancer takes the replica out and keep-alive clients reconnect
(to the other replicas on the port); after ``notice_s`` the listener closes, lets the requests in
progress finish within ``drain_s``, and stops.

A request the listener serves is invisible to Serve's request counting, so the replica reports its
in-flight count to the autoscaler itself (:meth:`Listener.in_flight`, see
``Gateway.record_autoscaling_stats``).

Slow and idle clients: uvicorn bounds only the idle time between requests (``keep_alive_s``);
:class:`GuardedHttpTools` (uvicorn's httptools protocol plus deadlines) also gives a request
``header_timeout_s`` to send its headers, counted from its first byte (from the connection's start
for the first request), and ``body_timeout_s`` more for its body, then answers 408 and closes; and
it refuses connections beyond ``max_connections`` with a 503 as soon as their request line names
the path (Anthropic's error shape on ``/v1/messages``, OpenAI's elsewhere), without parsing
the rest or running the app; one that sends no request line within ``header_timeout_s`` gets
OpenAI's.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from serving.errors import anthropic_error_body, error_body

logger = logging.getLogger("serving.gateway")

__all__ = ["GuardedHttpTools", "Listener", "bind_shared"]


def _raw_error(status: int, reason: str, body: bytes) -> bytes:
    """A whole HTTP answer with an error body, written straight to the socket."""
    head = f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
    return head.encode() + b"connection: close\r\nretry-after: 1\r\n\r\n" + body


_SLOW = "The request was not received in time."
_TOO_SLOW = _raw_error(408, "Request Timeout", error_body(_SLOW, "invalid_request_error"))
# a body too slow on /v1/messages...: the path is known by then, so Anthropic's shape
_TOO_SLOW_ANTHROPIC = _raw_error(408, "Request Timeout", anthropic_error_body(408, _SLOW))
_BUSY_MESSAGE = "Too many connections; retry shortly."
_BUSY = _raw_error(503, "Service Unavailable", error_body(_BUSY_MESSAGE, "service_unavailable"))
_BUSY_ANTHROPIC = _raw_error(503, "Service Unavailable", anthropic_error_body(503, _BUSY_MESSAGE))
_REQUEST_LINE_MAX = 8192  # bytes a refused connection may send before its request line is given up on


def _is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


class GuardedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol with header and body read deadlines and a connection limit
    (module docstring). :meth:`configured` makes a subclass with the limits set."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 0  # 0: no limit

    @classmethod
    def configured(cls, header_timeout_s: float, body_timeout_s: float, max_connections: int) -> type[GuardedHttpTools]:
        attrs = {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s}
        return type("GuardedHttpTools", (cls,), {**attrs, "max_connections": max_connections})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        self._refused: bytearray | None = None  # over the limit: what came before the request line
        super().connection_made(transport)
        if self.max_connections and len(self.connections) > self.max_connections:
            self._refused = bytearray()
        self._arm(self.header_timeout_s)

    def _refuse(self, head: bytes) -> None:
        """Answer a connection over the limit with a 503 in the shape of the path in ``head``
        (its request line, or b"" when none came) and close it."""
        self._disarm()
        parts = head.decode("latin-1").split(" ", 2)
        self.transport.write(_BUSY_ANTHROPIC if len(parts) > 1 and _is_anthropic(parts[1]) else _BUSY)
        self.transport.close()

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self._refused is not None:
            self._refuse(b"")
            return
        if self.cycle is None or self.cycle.response_complete or not self.cycle.response_started:
            # headers complete (a body too slow): the path is known, so is the error's shape
            path = str(self.cycle.scope.get("path", "")) if self.cycle is not None else ""
            self.transport.write(_TOO_SLOW_ANTHROPIC if _is_anthropic(path) else _TOO_SLOW)
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._refused is not None:
            if not self.transport.is_closing():
                self._refused += data
                end = self._refused.find(b"\r\n")
                if end >= 0 or len(self._refused) >= _REQUEST_LINE_MAX:
                    self._refuse(bytes(self._refused[:end] if end >= 0 else self._refused))
            return
        if self._deadline is None and (self.cycle is None or self.cycle.response_complete):
            self._arm(self.header_timeout_s)  # the first bytes of another request on this connection
        super().data_received(data)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._arm(self.body_timeout_s)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def bind_shared(host: str, port: int) -> socket.socket:
    """A listening TCP socket that other gateway replicas on this node may bind too."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.setblocking(False)
    return sock


READINESS_PATHS = frozenset({"/-/healthz", "/ready"})


class _Counted:
    """ASGI wrapper counting HTTP requests in progress (the autoscaling signal); once
    ``draining``, readiness fails and every response asks the client to close its connection."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.in_flight = 0
        self.draining = False

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.in_flight += 1
        try:
            if self.draining and scope["path"] in READINESS_PATHS:
                await _not_ready(send)
                return
            await self.app(scope, receive, self._closing_when_draining(send))
        finally:
            self.in_flight -= 1

    def _closing_when_draining(self, send: Any) -> Any:
        """``send`` that adds ``connection: close`` to a response that starts while draining."""

        async def wrapped(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and self.draining:
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        return wrapped


async def _not_ready(send: Any) -> None:
    body = b'{"status":"draining"}'
    headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Listener:
    """uvicorn serving ``app`` on ``host:port`` inside the current event loop."""

    def __init__(
        self,
        app: Any,
        host: str,
        port: int,
        keep_alive_s: int = 60,
        drain_s: float = 30.0,
        header_timeout_s: float = 10.0,
        body_timeout_s: float = 30.0,
        max_connections: int = 4096,
        notice_s: float = 0.0,
    ) -> None:
        self.host, self.port, self.notice_s = host, port, notice_s
        self._app = _Counted(app)
        config = uvicorn.Config(
            self._app,
            host=host,
            port=port,
            http=GuardedHttpTools.configured(header_timeout_s, body_timeout_s, max_connections),
            loop="none",
            lifespan="off",
            access_log=False,
            log_level="warning",
            timeout_keep_alive=keep_alive_s,
            timeout_graceful_shutdown=int(drain_s),
            server_header=False,
            date_header=False,
            proxy_headers=False,
        )
        self._server = uvicorn.Server(config)
        self._task: asyncio.Task[None] | None = None

    @property
    def in_flight(self) -> int:
        return self._app.in_flight

    @property
    def started(self) -> bool:
        return self._task is not None

    async def start(self, timeout_s: float = 30.0) -> None:
        sock = bind_shared(self.host, self.port)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("the gateway listener stopped while starting")
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"the gateway listener on {self.host}:{self.port} did not start")
            await asyncio.sleep(0.05)
        logger.info("gateway listening on %s:%d (SO_REUSEPORT)", self.host, self.port)

    @property
    def draining(self) -> bool:
        return self._app.draining

    async def stop(self) -> None:
        """Fail readiness and close connections after their response for ``notice_s`` (the load
        balancer notices), then stop accepting, let requests in progress finish (bounded by
        ``drain_s``), close."""
        if self._task is None:
            return
        self._app.draining = True
        if self.notice_s > 0:
            logger.info("gateway listener draining: readiness fails for %.0fs before it closes", self.notice_s)
            await asyncio.sleep(self.notice_s)
        self._server.should_exit = True
        try:
            await self._task
        except Exception:  # noqa: BLE001 - shutting down; nothing left to serve
            logger.exception("gateway listener stopped with an error")
        self._task = None
