"""Forwarding: get a replica (picked directly or leased through Ray Serve), stream its HTTP
bytes back, fail over.

Per request there is one HTTP exchange with the replica's vLLM server (and, for leases, one Ray
call); tokens never travel through Ray. A failure before the first byte reaches the client
(connection refused, engine dead, replica gone) releases the lease and retries on another replica;
after the first byte, the stream ends with an SSE error event, never a silent cut.

The client is aiohttp, not httpx: httpcore parses each chunk with h11 and wraps each read in an
anyio timeout, while aiohttp's C parser feeds a plain buffer, which more than halved the gateway's
CPU per streamed request in the relay benchmark (``python -m loadtests.relay``; figures in
docs/performance.md, "The relay"). The rest of the stack keeps httpx (control-plane calls, not
per token).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import aiohttp

from serving.errors import UpstreamError, sse_error_event
from serving.gateway.protocol import normalize_upstream_error
from serving.gateway.replicas import Lease, ReplicaGone

logger = logging.getLogger("serving.gateway")

__all__ = ["Leaser", "Observer", "Upstream", "UpstreamResult", "forward"]

RETRYABLE = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError)
T = TypeVar("T")


class Upstream:
    """The pooled HTTP client to model replicas (one aiohttp session, created on first use in
    the event loop that serves requests).

    Idle connections are dropped after ``keepalive_s``, below the 5 s after which vLLM's server
    closes them, so a request is never sent on a connection the server is closing."""

    def __init__(
        self, max_connections: int, timeout_s: float, connect_s: float = 5.0, keepalive_s: float = 4.0
    ) -> None:
        self.max_connections, self.timeout_s, self.connect_s = max_connections, timeout_s, connect_s
        self.keepalive_s = keepalive_s
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=self.max_connections, limit_per_host=0, keepalive_timeout=self.keepalive_s
                ),
                timeout=aiohttp.ClientTimeout(total=None, connect=self.connect_s, sock_read=self.timeout_s),
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding"),
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


Leaser = Callable[[], Awaitable[Lease]]


class Observer(Protocol):
    """Sees a request's bytes on their way back (usage, timings) and its end."""

    def feed(self, chunk: bytes) -> bytes: ...

    def flush(self) -> bytes: ...

    def retried(self) -> None: ...

    def finish(self, status: int, body: bytes | None = None) -> None: ...


@dataclass
class UpstreamResult:
    """What the route renders: a full body or a byte stream, plus the status and headers."""

    status: int
    headers: dict[str, str]
    body: bytes | None = None
    stream: AsyncIterator[bytes] | None = None
    replica: str = ""
    route: str = ""
    attempts: int = 1
    # Releases the lease and the upstream response if the stream was never (fully) iterated,
    # e.g. the client went away before the first byte was sent; idempotent.
    aclose: Callable[[], Awaitable[None]] | None = None


class _RetryableFailure(Exception):
    pass


async def _unless_dead(coro: Awaitable[T], lease: Lease) -> T:
    """Await ``coro`` unless the leased replica dies first (a dead replica's engine may never
    close its sockets, so waiting on them alone could hang until the upstream timeout)."""
    work = asyncio.ensure_future(coro)
    death = asyncio.ensure_future(lease.died.wait())
    try:
        done, _ = await asyncio.wait({work, death}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        death.cancel()
    if work in done:
        return work.result()
    work.cancel()
    raise _RetryableFailure(f"replica {lease.replica} died")


async def _open(
    client: Upstream, lease: Lease, path: str, body: bytes, request_id: str, stream: bool
) -> tuple[aiohttp.ClientResponse, bytes | None]:
    """Send the request; for streams the caller reads the first chunk so a replica that dies
    before its first byte can still be retried."""
    headers = {"authorization": f"Bearer {lease.token}", "content-type": "application/json", "x-request-id": request_id}
    try:
        resp = await client.session.post(lease.url + path, data=body, headers=headers)
    except RETRYABLE as exc:
        raise _RetryableFailure(f"{type(exc).__name__}: {exc}") from exc
    if resp.status >= 500:
        resp.close()
        raise _RetryableFailure(f"replica answered {resp.status}")
    if resp.status >= 400 or not stream:
        try:
            data = await resp.read()
        except RETRYABLE as exc:
            resp.close()
            raise _RetryableFailure(f"{type(exc).__name__}: {exc}") from exc
        resp.release()
        return resp, data
    return resp, None


async def _first_chunk(resp: aiohttp.ClientResponse) -> bytes:
    try:
        return await resp.content.readany()
    except RETRYABLE as exc:
        resp.close()
        raise _RetryableFailure(f"{type(exc).__name__}: {exc}") from exc


class _Cleanup:
    def __init__(self, resp: aiohttp.ClientResponse, lease: Lease, obs: Observer) -> None:
        self.resp, self.lease, self.obs, self.done = resp, lease, obs, False
        # A dead replica's engine may never close its sockets: close ours so the read ends.
        self.watcher = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        await self.lease.died.wait()
        self.resp.close()

    async def __call__(self, status: int = 499) -> None:
        if self.done:
            return
        self.done = True
        self.watcher.cancel()
        try:
            if status == 200:
                self.resp.release()
            else:
                self.resp.close()
        finally:
            self.lease.release()
            self.obs.finish(status)


async def _relay(first: bytes, cleanup: _Cleanup, request_id: str, obs: Observer) -> AsyncIterator[bytes]:
    lease, content = cleanup.lease, cleanup.resp.content
    status = 499  # client went away, unless we get to the end
    try:
        out = obs.feed(first) if first else b""
        if out:
            yield out
        while True:
            chunk = await content.readany()
            if not chunk:
                break
            out = obs.feed(chunk)
            if out:
                yield out
        tail = obs.flush()
        if tail:
            yield tail
        status = 200
    except RETRYABLE as exc:
        status = 502
        logger.warning("[%s] stream from %s broke: %s", request_id, lease.replica, type(exc).__name__)
        yield obs.flush() + sse_error_event(
            UpstreamError("The model replica failed while streaming; the response is incomplete."),
            request_id,
        )
    finally:
        await cleanup(status)


async def forward(
    *,
    client: Upstream,
    leaser: Leaser,
    path: str,
    body: bytes,
    stream: bool,
    request_id: str,
    retries: int,
    obs: Observer,
) -> UpstreamResult:
    """Run one request against the model tier with failover before the first byte."""
    last: str = "no attempt"
    for attempt in range(1, retries + 2):
        if attempt > 1:
            obs.retried()
            await asyncio.sleep(min(0.25 * (attempt - 1), 1.0))
        try:
            lease = await leaser()
        except ReplicaGone as exc:
            last = str(exc)
            logger.warning("[%s] lease attempt %d failed: %s", request_id, attempt, last)
            continue
        try:
            resp, data = await _unless_dead(_open(client, lease, path, body, request_id, stream), lease)
            headers = {"content-type": resp.headers.get("content-type", "application/json")}
            if data is not None:
                lease.release()
                if resp.status >= 400:
                    data = normalize_upstream_error(resp.status, data)
                obs.finish(resp.status, data)
                return UpstreamResult(
                    resp.status, headers, data, replica=lease.replica, route=lease.route, attempts=attempt
                )
            try:
                first = await _unless_dead(_first_chunk(resp), lease)
            except _RetryableFailure:
                resp.close()
                raise
        except _RetryableFailure as exc:
            lease.release(failed=True)
            last = str(exc)
            logger.warning("[%s] attempt %d on %s failed: %s", request_id, attempt, lease.replica, last)
            continue
        except BaseException:
            lease.release()
            raise
        cleanup = _Cleanup(resp, lease, obs)
        return UpstreamResult(
            200,
            headers,
            stream=_relay(first, cleanup, request_id, obs),
            replica=lease.replica,
            route=lease.route,
            attempts=attempt,
            aclose=cleanup,
        )
    obs.finish(502)
    raise UpstreamError(f"No model replica could serve the request after {retries + 1} attempts.")
