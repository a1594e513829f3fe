"""Forwarding: get a replica (picked directly or leased through Ray Serve), stream its HTTP
bytes back, fail over.

Per request there is one HTTP exchange with the replica's vLLM server (and, for leases, one Ray
call); tokens never travel through Ray. Only what is safe to send again is retried on another
replica, and only while the retry budget (:class:`RetryBudget`) allows:

- the connection failed before any response byte (refused, reset, closed by the server);
- the replica is known dead (its lease died, or vLLM answered 503, which it does when its engine
  is dead, not when it is busy);
- no byte came within ``first_byte_s`` (the connection is closed, so the engine drops the request);
- the replica answered with an error of its own (5xx) and then failed its ``/health`` check: a
  replica that is shutting down (its actor was killed, its engine is stopping) fails requests it
  had not begun, and those are safe to send elsewhere;
- for a LoRA adapter only, vLLM's 404 that its name does not exist: the replica unregistered it
  since the gateway read its record (:func:`serving.gateway.leases.adapter_missing`; not a failure).

All but the last mark the replica failed (skipped for a few seconds). Any other answer of the
engine, an error included (e.g. its 500 for a grammar it cannot satisfy), reaches the client once,
in OpenAI's shape with the request id, and the replica stays in rotation. Waiting for a free pooled
connection (``Upstream.max_connections``) is the gateway's own limit: a 503, never a replica
failure. After the first byte, the stream ends with an SSE error event, never a silent cut,
unless the observer continues it on another replica (:mod:`serving.gateway.migration`); a 5xx
error event that vLLM sends when its engine dies counts as such a break once ``/health`` fails.

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

from serving.errors import ErrorShape, Unavailable, UpstreamError
from serving.gateway.answers import normalize_upstream_error
from serving.gateway.budget import RetryBudget
from serving.gateway.leases import adapter_missing
from serving.gateway.replicas import Lease, ReplicaGone

logger = logging.getLogger("serving.gateway")

__all__ = ["Leaser", "Observer", "RetryBudget", "Upstream", "UpstreamResult", "forward"]

# Read errors of a response under way (a stream cut, a read timeout): never retried.
BROKEN = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError)
T = TypeVar("T")


class Upstream:
    """The pooled HTTP client to model replicas (one aiohttp session, created on first use in
    the event loop that serves requests).

    Idle connections are dropped after ``keepalive_s``, below the 5 s after which vLLM's server
    closes them, so a request is never sent on a connection the server is closing.

    At most ``max_connections`` requests are open upstream at once (:meth:`slot`); a request waits
    up to ``pool_wait_s`` for one, then gets a 503. That wait is kept apart from connecting
    (``connect_s``, a replica fault) so a busy gateway never blames a replica for it."""

    def __init__(
        self,
        max_connections: int,
        timeout_s: float,
        connect_s: float = 5.0,
        keepalive_s: float = 4.0,
        pool_wait_s: float = 10.0,
    ) -> None:
        self.max_connections, self.timeout_s, self.connect_s = max_connections, timeout_s, connect_s
        self.keepalive_s, self.pool_wait_s = keepalive_s, pool_wait_s
        self._slots = asyncio.Semaphore(max_connections)
        self._session: aiohttp.ClientSession | None = None

    async def slot(self) -> Callable[[], None]:
        """Wait for a free upstream connection slot; returns its (idempotent) release."""
        try:
            await asyncio.wait_for(self._slots.acquire(), self.pool_wait_s)
        except TimeoutError:
            raise Unavailable(
                "The gateway is at its limit of open model connections; retry shortly.",
                headers={"retry-after": "1"},
            ) from None
        done = False

        def release() -> None:
            nonlocal done
            if not done:
                done = True
                self._slots.release()

        return release

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                # no pool limit here: ``slot`` bounds the requests (aiohttp's pool wait would count
                # as a connect timeout, i.e. as a replica fault)
                connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=self.keepalive_s),
                timeout=aiohttp.ClientTimeout(
                    total=None, connect=None, sock_connect=self.connect_s, sock_read=self.timeout_s
                ),
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding"),
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


Leaser = Callable[[], Awaitable[Lease]]


class Observer(Protocol):
    """Sees a request's bytes on their way back (usage, timings) and its end.

    ``held_error``: the stream ended with a 5xx error event that the observer kept back (the
    relay then asks the replica's ``/health``); ``failed`` gives the bytes that end a stream that
    broke after its first byte (an SSE error event, or nothing when the observer continues the
    stream on another replica, :mod:`serving.gateway.migration`)."""

    @property
    def held_error(self) -> bool: ...

    def feed(self, chunk: bytes) -> bytes: ...

    def flush(self) -> bytes: ...

    def failed(self, request_id: str) -> bytes: ...

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
    """This try failed in a way that is safe to send again elsewhere; the replica is marked failed."""

    def __init__(self, message: str, status: int = 502, replica_fault: bool = True) -> None:
        super().__init__(message)
        self.status = status  # what the client gets if no retry is left: 502, or 503 for vLLM's 503
        self.replica_fault = replica_fault  # False: the replica lacks the adapter, and is fine otherwise


class _Broken(Exception):
    """The replica's answer broke after it began (not safe to send again): a 502, replica failed."""


async def _unless_dead(
    coro: Awaitable[T], lease: Lease, first_byte_s: float | None = None, discard: Callable[[T], None] | None = None
) -> T:
    """Await ``coro`` unless the leased replica dies first (a dead replica's engine may never
    close its sockets, so waiting on them alone could hang until the upstream timeout) or
    ``first_byte_s`` passes (then the caller closes the connection and the engine drops it).
    ``discard`` gets a result that came just as the caller was cancelled (nobody takes it on)."""
    work = asyncio.ensure_future(coro)
    death = asyncio.ensure_future(lease.died.wait())
    try:
        done, _ = await asyncio.wait({work, death}, timeout=first_byte_s, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # cancelled (the client left): the upstream request goes too
        if not work.cancel() and discard is not None and not work.cancelled() and work.exception() is None:
            discard(work.result())
        raise
    finally:
        death.cancel()
    if work in done:
        return work.result()
    work.cancel()
    if death in done:
        raise _RetryableFailure(f"replica {lease.replica} died")
    raise _RetryableFailure(f"no response byte within {first_byte_s:g}s")


async def _open(
    client: Upstream, lease: Lease, path: str, body: bytes, request_id: str, stream: bool
) -> tuple[aiohttp.ClientResponse, bytes | None]:
    """Send the request; for streams the caller reads the first chunk so a replica that dies
    before its first byte can still be retried."""
    headers = {"authorization": f"Bearer {lease.token}", "content-type": "application/json", "x-request-id": request_id}
    try:
        resp = await client.session.post(lease.url + path, data=body, headers=headers)
    except aiohttp.ClientConnectionError as exc:  # refused, reset or closed before any response byte
        raise _RetryableFailure(f"{type(exc).__name__}: {exc}") from exc
    if resp.status == 503:  # vLLM's answer when its engine is dead
        resp.close()
        raise _RetryableFailure("replica answered 503 (engine unavailable)", status=503)
    if resp.status >= 400 or not stream:
        try:
            data = await resp.read()
        except BROKEN as exc:
            resp.close()
            raise _Broken(f"{type(exc).__name__} reading the answer") from exc
        except BaseException:  # cancelled (the client left, or the try timed out): the engine stops
            resp.close()
            raise
        resp.release()
        if adapter_missing(lease, resp.status, data):
            raise _RetryableFailure("the replica does not hold the adapter", 503, replica_fault=False)
        if resp.status >= 500 and not await _healthy(client, lease):
            raise _RetryableFailure(f"replica answered {resp.status} and then failed its health check")
        return resp, data
    return resp, None


async def _healthy(client: Upstream, lease: Lease) -> bool:
    """Whether the replica's engine still answers ``/health`` (asked only after a 5xx answer)."""
    try:
        async with client.session.get(lease.url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
            return r.status == 200
    except (TimeoutError, aiohttp.ClientError):
        return False


async def _first_chunk(resp: aiohttp.ClientResponse) -> bytes:
    try:
        return await resp.content.readany()
    except BROKEN as exc:  # the stream's head came, its first event did not: nothing sent yet
        raise _RetryableFailure(f"{type(exc).__name__}: {exc}") from exc


def _close_opened(opened: tuple[aiohttp.ClientResponse, bytes | None]) -> None:
    opened[0].close()


class _Cleanup:
    def __init__(
        self, client: Upstream, resp: aiohttp.ClientResponse, lease: Lease, obs: Observer, slot: Callable[[], None]
    ) -> None:
        self.client, self.resp, self.lease, self.obs, self.slot, self.done = client, resp, lease, obs, slot, False
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
            self.slot()
            self.lease.release(failed=status == 502)
            self.obs.finish(status)


async def _relay(
    first: bytes, cleanup: _Cleanup, request_id: str, obs: Observer, shape: ErrorShape = "openai"
) -> AsyncIterator[bytes]:
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
        died = obs.held_error and not await _healthy(cleanup.client, lease)  # it said so in the stream
        if died:
            logger.warning("[%s] the engine of %s failed while streaming", request_id, lease.replica)
        end = obs.failed(request_id) if died else obs.flush()
        if end:
            yield end
        status = 502 if died else 200
    except BROKEN as exc:
        status = 502
        logger.warning("[%s] stream from %s broke: %s", request_id, lease.replica, type(exc).__name__)
        end = obs.failed(request_id)
        if end:
            yield end
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
    budget: RetryBudget | None = None,
    first_byte_s: float | None = None,
    shape: ErrorShape = "openai",
) -> UpstreamResult:
    """Run one request against the model tier with failover before the first byte (module
    docstring: what is retried). ``first_byte_s`` bounds each try's wait for its first byte;
    ``shape`` is the error format of the route (engine errors are rewritten to it)."""
    last, status, tried = "no attempt", 502, 0
    if budget is not None:
        budget.request()
    for attempt in range(1, retries + 2):
        if attempt > 1:
            if budget is not None and not budget.try_retry():
                last += "; retry budget spent"
                break
            obs.retried()
            await asyncio.sleep(min(0.25 * (attempt - 1), 1.0))
        tried = attempt
        release_slot = await client.slot()
        try:
            lease = await leaser()
        except ReplicaGone as exc:
            release_slot()
            last, status = str(exc), 502
            logger.warning("[%s] lease attempt %d failed: %s", request_id, attempt, last)
            continue
        except BaseException:
            release_slot()
            raise
        try:
            opening = _open(client, lease, path, body, request_id, stream)
            resp, data = await _unless_dead(opening, lease, first_byte_s, discard=_close_opened)
            headers = {"content-type": resp.headers.get("content-type", "application/json")}
            if data is not None:
                release_slot()
                lease.release()
                if resp.status >= 400:
                    data = normalize_upstream_error(resp.status, data, request_id, shape)
                obs.finish(resp.status, data)
                return UpstreamResult(
                    resp.status, headers, data, replica=lease.replica, route=lease.route, attempts=attempt
                )
            try:
                first = await _unless_dead(_first_chunk(resp), lease, first_byte_s)
            except BaseException:  # retried, or the client left: the engine sees the connection close now
                resp.close()
                raise
        except _RetryableFailure as exc:
            release_slot()
            lease.release(failed=exc.replica_fault)
            last, status = str(exc), exc.status
            logger.warning("[%s] attempt %d on %s failed: %s", request_id, attempt, lease.replica, last)
            continue
        except _Broken as exc:
            release_slot()
            lease.release(failed=True)
            logger.warning("[%s] answer from %s broke: %s", request_id, lease.replica, exc)
            obs.finish(502)
            raise UpstreamError("The model replica failed while answering; retry the request.") from None
        except BaseException:
            release_slot()
            lease.release()
            raise
        cleanup = _Cleanup(client, resp, lease, obs, release_slot)
        return UpstreamResult(
            200,
            headers,
            stream=_relay(first, cleanup, request_id, obs, shape),
            replica=lease.replica,
            route=lease.route,
            attempts=attempt,
            aclose=cleanup,
        )
    obs.finish(status)
    logger.warning("[%s] giving up: %s", request_id, last)
    if status == 503:
        raise Unavailable("The model's replicas are unavailable; retry shortly.", headers={"retry-after": "1"})
    raise UpstreamError(f"No model replica could serve the request after {tried} attempts.")
