"""The model deployment: one Ray Serve replica = one vLLM OpenAI server for one model version.

Why not ``ray.serve.llm.LLMServer``: there every token travels back to the ingress as a Ray
object-stream item, and the stock path measured at 0.46x bare vLLM's throughput on the 2-core box
(shared/ENVIRONMENT.md). Here the replica runs vLLM's own OpenAI server as a child process on a
private port guarded by a per-replica random token, and the gateway streams HTTP bytes from it
directly. Ray Serve still does what it is good at -- placement, health checks, restarts,
autoscaling, queue-length-aware routing -- through one *lease* call per request: ``lease()`` is a
streaming method that yields the replica's endpoint and then stays open until the gateway cancels
it when the request ends, so Serve counts in-flight requests per replica exactly.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from serving.models.engine import EngineSpec, vllm_command, vllm_env

logger = logging.getLogger("ray.serve")

__all__ = ["Endpoint", "LeaseHint", "ModelServer"]


@dataclass(frozen=True)
class LeaseHint:
    """What request routers may look at. ``prompt`` is set only for prefix-affinity routing
    (ray.serve.llm's PrefixCacheAffinityRouter reads ``.prompt``); ``session_id`` for session
    affinity."""

    prompt: str | None = None
    session_id: str | None = None


@dataclass(frozen=True)
class Endpoint:
    url: str
    token: str
    replica: str


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """In the engine child: get SIGTERM if the replica process dies (even by SIGKILL)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _node_ip() -> str:
    try:
        import ray

        return str(ray.util.get_node_ip_address())
    except Exception:  # not inside Ray (unit use)
        return "127.0.0.1"


def _replica_tag() -> str:
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_tag)
    except Exception:
        return f"pid-{os.getpid()}"


class ModelServer:
    """Serve deployment class; the app builder wraps it with ``serve.deployment`` options."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = EngineSpec.model_validate(spec)
        self.host = _node_ip()
        self.port = _free_port(self.host)
        self.token = secrets.token_urlsafe(24)
        self.replica = _replica_tag()
        self.endpoint = Endpoint(f"http://{self.host}:{self.port}", self.token, self.replica)
        env = {**os.environ, **vllm_env(self.spec)}
        cmd = [sys.executable, *vllm_command(self.spec, self.host, self.port, self.token)]
        logger.info("starting vLLM for %s@%s on port %d", self.spec.model, self.spec.version, self.port)
        # New session: the engine's processes die with it when we stop it (killpg).
        self.proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent)
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(5.0))
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.spec.startup_timeout_s
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"vLLM exited with code {self.proc.returncode} during start")
                try:
                    if client.get(f"{self.endpoint.url}/health").status_code == 200:
                        logger.info("vLLM ready for %s@%s", self.spec.model, self.spec.version)
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        self._stop()
        raise TimeoutError(f"vLLM not ready after {self.spec.startup_timeout_s}s")

    async def lease(self, hint: LeaseHint | None = None) -> AsyncIterator[Endpoint]:
        """Yield this replica's endpoint, then hold the lease open until the caller cancels."""
        if self.proc.poll() is not None:
            raise RuntimeError("vLLM engine process is not running")
        yield self.endpoint
        await asyncio.Event().wait()  # released by cancellation from the gateway

    async def ready(self) -> bool:
        return self.proc.poll() is None

    async def check_health(self) -> None:
        """Serve's health check: the engine process must live and answer /health."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with code {self.proc.returncode}")
        resp = await self._client.get(f"{self.endpoint.url}/health")
        if resp.status_code != 200:
            raise RuntimeError(f"vLLM /health answered {resp.status_code}")

    def _stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def __del__(self) -> None:
        self._stop()
