"""What a lease is beyond the gateway's replica table (:mod:`serving.gateway.replicas`).

- :class:`ServeLease`: a lease through Ray Serve's router: one streaming call to the replica's
  ``lease`` method that yields its endpoint and stays open until the request ends, so Serve's
  router, queue and backpressure see the request.
- :func:`adapter_missing`: whether an engine's answer says that the lease's replica does not hold
  the LoRA adapter the request was sent there for.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import msgspec
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentResponseGenerator

from serving.contract import Endpoint

logger = logging.getLogger("serving.gateway")

__all__ = ["ServeLease", "adapter_missing", "cancel_call"]


def cancel_call(gen: DeploymentResponseGenerator[Endpoint]) -> None:
    """End a lease call; a call that already failed (its replica died) has nothing to end."""
    try:
        gen.cancel()
    except Exception:  # noqa: BLE001 - the call's own error was handled where it surfaced
        pass


class ServeLease:
    """A leased replica. The lease call stays open while the request runs; if the replica dies,
    Ray fails that call at once and ``died`` is set, so the gateway stops waiting on its sockets."""

    __slots__ = ("_gen", "_missing", "_watcher", "adapter", "died", "replica", "token", "url")
    route = "serve"

    def __init__(
        self,
        gen: DeploymentResponseGenerator[Endpoint],
        endpoint: Endpoint,
        adapter: str | None = None,
        missing: Callable[[], None] | None = None,
    ) -> None:
        self._gen = gen
        self.url = endpoint.url
        self.token = endpoint.token
        self.replica = endpoint.replica
        self.adapter, self._missing = adapter, missing
        self.died = asyncio.Event()
        self._watcher = asyncio.ensure_future(self._watch())

    def adapter_missing(self) -> None:
        if self._missing is not None:
            self._missing()

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
        cancel_call(self._gen)


def adapter_missing(lease: Any, status: int, body: bytes) -> bool:
    """The engine answered a request for the lease's adapter with vLLM's 404 for a model it does
    not serve (``The model `sub@v1` does not exist.``): its replica unregistered the adapter after
    the gateway read its record. The lease is told (``adapter_missing()``: the table stops picking
    that replica for the adapter). Nothing ran, so the request may be sent elsewhere. Any other
    answer, and this one for a request without an adapter, is the engine's to give."""
    adapter = getattr(lease, "adapter", None)
    if status != 404 or not isinstance(adapter, str):
        return False
    try:
        message = msgspec.json.decode(body)["error"]["message"]
    except (msgspec.DecodeError, KeyError, TypeError):
        return False
    if not (isinstance(message, str) and message.startswith(f"The model `{adapter}` does not exist")):
        return False
    lease.adapter_missing()
    return True
