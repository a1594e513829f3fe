"""Forwarding: get a replica (picked directly or leased through Ray Serve), stream its HTTP
bytes back, fail over.

Per request there is one HTTP exchange with the replica's vLLM server (and, for leases, one Ray
call); tokens never travel through Ray. A failure before the first byte reaches the client
(connection refused, engine dead, replica gone) releases the lease and retries on another replica;
after the first byte, the stream ends with an SSE error event, never a silent cut.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import httpx

from serving.errors import UpstreamError, sse_error_event
from serving.protocol import normalize_upstream_error

logger = logging.getLogger("serving.gateway")

__all__ = ["Lease", "Leaser", "Observer", "ReplicaGone", "UpstreamResult", "forward"]

RETRYABLE = (httpx.TransportError,)
T = TypeVar("T")


class Lease(Protocol):
    url: str
    token: str
    replica: str
    died: asyncio.Event  # set when the leased replica dies (Ray tells the lease call at once)
    route: str  # "direct" (picked by the gateway) or "serve" (leased through Serve's router)

    def release(self, failed: bool = False) -> None: ...


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


class ReplicaGone(_RetryableFailure):
    """Raised by a leaser when the leased replica died before answering; the request is retried."""


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


_DEAD = object()


async def _pump(chunks: AsyncIterator[bytes], lease: Lease) -> AsyncIterator[bytes]:
    """Chunks as they come, ending with ReadError if the replica dies mid-stream."""
    queue: asyncio.Queue[object] = asyncio.Queue()

    async def read() -> None:
        try:
            async for chunk in chunks:
                queue.put_nowait(chunk)
            queue.put_nowait(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait(exc)

    async def watch() -> None:
        await lease.died.wait()
        queue.put_nowait(_DEAD)

    reader, watcher = asyncio.ensure_future(read()), asyncio.ensure_future(watch())
    try:
        while True:
            item = await queue.get()
            if item is None:
                return
            if item is _DEAD:
                raise httpx.ReadError(f"replica {lease.replica} died")
            if isinstance(item, BaseException):
                raise item
            yield item  # type: ignore[misc]
    finally:
        reader.cancel()
        watcher.cancel()


async def _open(
    client: httpx.AsyncClient, lease: Lease, path: str, body: bytes, request_id: str, stream: bool
) -> tuple[httpx.Response, bytes | None]:
    """Send the request; for streams also read the first chunk so a replica that dies before
    its first byte can still be retried."""
    req = client.build_request(
        "POST",
        lease.url + path,
        content=body,
        headers={
            "authorization": f"Bearer {lease.token}",
            "content-type": "application/json",
            "x-request-id": request_id,
        },
    )
    try:
        resp = await client.send(req, stream=True)
    except RETRYABLE as exc:
        raise _RetryableFailure(f"{type(exc).__name__}: {exc}") from exc
    if resp.status_code >= 500:
        await resp.aclose()
        raise _RetryableFailure(f"replica answered {resp.status_code}")
    if resp.status_code >= 400 or not stream:
        try:
            data = await resp.aread()
        except RETRYABLE as exc:
            raise _RetryableFailure(f"{type(exc).__name__}: {exc}") from exc
        finally:
            await resp.aclose()
        return resp, data
    return resp, None


async def _first_chunk(resp: httpx.Response, chunks: AsyncIterator[bytes]) -> bytes:
    try:
        return await chunks.__anext__()
    except StopAsyncIteration:
        return b""
    except RETRYABLE as exc:
        await resp.aclose()
        raise _RetryableFailure(f"{type(exc).__name__}: {exc}") from exc


class _Cleanup:
    def __init__(self, resp: httpx.Response, lease: Lease, obs: Observer) -> None:
        self.resp, self.lease, self.obs, self.done = resp, lease, obs, False

    async def __call__(self, status: int = 499) -> None:
        if self.done:
            return
        self.done = True
        try:
            await self.resp.aclose()
        finally:
            self.lease.release()
            self.obs.finish(status)


async def _relay(
    first: bytes,
    chunks: AsyncIterator[bytes],
    cleanup: _Cleanup,
    request_id: str,
    obs: Observer,
) -> AsyncIterator[bytes]:
    lease = cleanup.lease
    status = 499  # client went away, unless we get to the end
    try:
        out = obs.feed(first) if first else b""
        if out:
            yield out
        async for chunk in chunks:
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
    client: httpx.AsyncClient,
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
                if resp.status_code >= 400:
                    data = normalize_upstream_error(resp.status_code, data)
                obs.finish(resp.status_code, data)
                return UpstreamResult(resp.status_code, headers, data, replica=lease.replica,
                                      route=lease.route, attempts=attempt)  # fmt: skip
            chunks = _pump(resp.aiter_raw(), lease)
            try:
                first = await _unless_dead(_first_chunk(resp, chunks), lease)
            except _RetryableFailure:
                await resp.aclose()
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
            200, headers, stream=_relay(first, chunks, cleanup, request_id, obs),
            replica=lease.replica, route=lease.route, attempts=attempt, aclose=cleanup,
        )  # fmt: skip
    obs.finish(502)
    raise UpstreamError(f"No model replica could serve the request after {retries + 1} attempts.")
