"""The model deployment: one Ray Serve replica = one vLLM OpenAI server for one model version.

Why not ``ray.serve.llm.LLMServer``: there every token travels back to the ingress as a Ray
object-stream item, which the benchmark measures far below bare vLLM (docs/performance.md,
"Three servers"). Here the replica runs vLLM's own OpenAI server as a child process on a
private port guarded by a per-replica random token, and the gateway streams HTTP bytes from it
directly. Ray Serve still does what it is good at -- placement, health checks, restarts,
autoscaling -- and the gateway finds the replica one of two ways (:mod:`serving.contract`):

- **direct** (``gateway.replica_routing: direct``, the default, for power-of-two routing): the
  replica publishes its endpoint in Ray's key-value store and the gateway picks among them
  itself; no Ray call per request. The replica reports its engine's running + waiting requests
  to Serve's autoscaler (``record_autoscaling_stats``), and when Serve stops it, it withdraws
  its endpoint and drains before stopping vLLM.
- **lease**: one Serve call per request (prefix or session affinity, scale from zero, or
  ``replica_routing: serve``): ``lease()`` is a streaming method that yields the endpoint and stays
  open until the gateway cancels it when the request ends, so Serve's router sees it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import sys
import threading
import time
from collections.abc import AsyncIterator
from subprocess import PIPE, STDOUT, Popen
from typing import Any

import httpx

from serving import contract
from serving.contract import RUNNING_REQUESTS_KEY, Endpoint, LeaseHint
from serving.replica.adapter_slots import base_manifest_sha256, multiplexed, register
from serving.replica.adapters import AdapterSet
from serving.replica.engine import EngineSpec, engine_environ, single_process, verified_spec, vllm_command
from serving.replica.engine_main import guarded
from serving.replica.engine_output import EngineOutput
from serving.replica.engine_stop import ENGINE_STOP_S, stop_engine
from serving.replica.kv_events import KVEventRelay
from serving.replica.liveness import ONE_TOKEN, PROGRESS_COUNTERS, StallWatch, warm_up
from serving.replica.node import engine_cores, free_port, node_ip, placement_group_gpus
from serving.replica.placement import EnginePinning, engine_core_pid
from serving.waiting import poll

logger = logging.getLogger("ray.serve")

__all__ = ["ModelServer", "build_model_server"]


def _engine_load(values: dict[str, float]) -> float:
    """Requests the engine holds: running plus waiting (from its /metrics)."""
    return values.get("vllm:num_requests_running", 0.0) + values.get("vllm:num_requests_waiting", 0.0)


def _replica_tag() -> tuple[str, str | None]:
    """This replica's tag and Serve application (None outside Serve)."""
    try:
        from ray import serve

        ctx = serve.get_replica_context()
        return str(ctx.replica_tag), str(ctx.app_name)
    except Exception:
        return f"pid-{os.getpid()}", None


class ModelServer:
    """Serve deployment class; the app builder wraps it with ``serve.deployment`` options."""

    def __init__(self, spec: dict[str, Any]) -> None:
        # the weights first: a tampered or partial version fails here, before any engine starts
        self.spec = verified_spec(EngineSpec.model_validate(spec))
        self.host = node_ip()
        self.port = free_port(self.host)
        self.token = secrets.token_urlsafe(24)
        self.replica, self.app = _replica_tag()
        self.endpoint = Endpoint(f"http://{self.host}:{self.port}", self.token, self.replica)
        self.cores = engine_cores(self.spec)
        env = engine_environ(dict(os.environ), self.spec, self.cores, self.token)
        gpus = placement_group_gpus(self.spec)
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = gpus
        # router kv_aware: the engine publishes KV events on a private ipc socket, relayed as block keys
        self.relay = KVEventRelay(self.token, self.spec.path) if self.spec.kv_events else None
        kv_config = self.relay.config if self.relay else None
        # The engine's group is killed at once if this process dies (serving.replica.engine_main):
        # it holds the pipe's write end for as long as it lives.
        watch_fd, lifeline = os.pipe()
        self._lifeline: int | None = lifeline
        cmd = [sys.executable, *guarded(watch_fd, vllm_command(self.spec, self.host, self.port, kv_config))]
        logger.info("starting vLLM for %s@%s on port %d", self.spec.model, self.spec.version, self.port)
        # New session: the engine's processes die with it when we stop it (killpg).
        try:
            self.proc = Popen(cmd, env=env, start_new_session=True, pass_fds=(watch_fd,), stdout=PIPE, stderr=STDOUT)
        finally:
            os.close(watch_fd)
        self.output = EngineOutput(self.proc.stdout)  # on to the replica's log; a failed start says why
        # every engine route but /health needs the token (serving.replica.engine_guard), /metrics too
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(5.0), headers={"authorization": f"Bearer {self.token}"})
        self._wait_ready()
        pin = self.cores and self.spec.engine.pin_cores and single_process(self.spec)
        engine_pid = engine_core_pid(self.proc.pid) if pin else None
        if pin and engine_pid is None:
            logger.warning("no EngineCore under the API server (pid %d): the engine is not pinned", self.proc.pid)
        self._pinning = EnginePinning(self.proc.pid, engine_pid, self.cores) if engine_pid and self.cores else None
        self._pin()
        if self.spec.engine.runner == "generate":
            warm_up(self.endpoint.url, self.token, self.spec.model, self.spec.startup_timeout_s)
        self._tasks: list[asyncio.Task[None]] = []
        self._seq = 0  # heartbeats published
        self._stall = StallWatch(self.spec.stall_timeout_s)
        self._hung: str | None = None  # why the engine is taken for hung (then never cleared)
        self._probe: asyncio.Task[None] | None = None
        self._load = 0.0  # the engine's running + waiting requests, read every second
        self._draining = False
        self._publishing = threading.Lock()
        self._kv: contract.KV | None = None
        self.adapters: AdapterSet | None = None
        self._adapter: Any = None  # Serve's multiplexed loader of adapters (LRU per replica)
        if self.spec.lora is not None:
            tags = {"model": self.spec.model, "version": self.spec.version, "replica": self.replica}
            base = base_manifest_sha256(self.spec)  # an adapter trained on other weights is refused
            self.adapters = AdapterSet(
                self._client, self.endpoint.url, self.spec.lora, self._published_soon, tags, base_sha256=base
            )
            self._adapter = multiplexed(self.adapters, self.spec.lora.max_cpu_loras)
        if self.app is not None:
            try:
                self._kv = contract.RayKV()
                self._publish()
            except Exception as exc:  # noqa: BLE001 - without the store, gateways lease through Serve
                logger.warning("cannot publish the endpoint (%s); gateways will lease through Serve", exc)
                self._kv = None

    def _pin(self) -> None:
        """A single-process CPU engine on its claimed cores, its API server on the node's unclaimed
        ones (none when every core is claimed: then both may use every core); re-applied every few
        seconds as engines come and go on this node."""
        pinning = self._pinning
        if pinning is None or self.proc.poll() is not None:
            return
        try:
            rest = pinning.apply()
        except OSError as exc:  # the engine is going away, or affinity is not ours to set
            logger.warning("cannot pin the engine: %s", exc)
            self._pinning = None
            return
        if rest is None:
            return
        if rest:
            logger.info("engine core process %d on cores %s, API server on %s", pinning.engine_pid, pinning.cores, rest)
        else:
            logger.info("every core is claimed by an engine: engine and API server unpinned")

    def _publish(self) -> None:
        with self._publishing:  # the drain takes it: no heartbeat in flight writes the record again
            self._publish_now()

    def _stop_publishing(self) -> None:
        with getattr(self, "_publishing", threading.Lock()):  # a heartbeat in flight ends first
            self._draining = True

    def _publish_now(self) -> None:
        if self._kv is not None and self.app is not None and not self._draining and self.proc.poll() is None:
            self._seq += 1
            state = contract.HUNG if self._hung else contract.UP
            held = self.adapters.names if self.adapters else ()
            ep = self.endpoint
            events = self.relay.url if self.relay else ""
            contract.publish(self._kv, self.app, self.replica, ep.url, ep.token, self._seq, state, held, events)

    def _published_soon(self) -> None:
        """The registered adapters changed: publish the record now, not at the next heartbeat."""
        if self._kv is not None:
            asyncio.get_running_loop().run_in_executor(None, self._publish)

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """The base deployment's ``user_config``: the adapter versions it may register (on the
        replica's event loop, where adapters retire)."""
        if self.adapters is not None:
            self.adapters.configure(dict(user_config.get("adapters", {})), dict(user_config.get("pins", {})))

    async def _engine_values(self) -> dict[str, float]:
        from serving.metrics import EngineMetrics, parse_prometheus_values

        resp = await self._client.get(f"{self.endpoint.url}/metrics")
        if self.adapters is not None:
            for name in self.adapters.in_use(resp.text):
                await self._adapter(name)  # held: only marks it recently used in the multiplexer
        return parse_prometheus_values(resp.text, {*EngineMetrics.FIELDS, *PROGRESS_COUNTERS})

    async def _scrape_forever(self) -> None:
        """Every second: the engine's load (for autoscaling and draining); every 5 s the engine
        gauges into Ray's metrics. A slow or failed scrape delays only this loop."""
        from serving.metrics import EngineMetrics

        metrics = EngineMetrics()
        tags = {"model": self.spec.model, "version": self.spec.version, "replica": self.replica}
        tick = 0
        while True:
            try:
                values = await self._engine_values()
                self._load = _engine_load(values)
                if tick % 5 == 0:
                    metrics.set(values, tags)
                now = time.monotonic()
                if self._hung is None and self._stall.observe(values, now):
                    await self._mark_hung()
                elif self._hung is None and self._probe is None and self._stall.should_probe(now):
                    self._probe = asyncio.get_running_loop().create_task(self._probe_engine())
            except httpx.HTTPError:
                self._stall.reset()  # no evidence either way
            except Exception:  # noqa: BLE001 - a bug here must not end the loop silently
                logger.exception("engine scrape failed")
                self._stall.reset()
            if tick % 2 == 0:
                self._pin()
            tick += 1
            await asyncio.sleep(1)

    async def _probe_engine(self) -> None:
        """One token from the engine (one embedding from a pooling one); no answer within
        ``stall_timeout_s`` while the server still answers /health means the engine is hung
        (:mod:`serving.replica.liveness`)."""
        body: dict[str, object]
        if self.spec.engine.runner == "pooling":
            path, body = "/v1/embeddings", {"model": self.spec.model, "input": [0]}
        else:
            path, body = "/v1/completions", {"model": self.spec.model, **ONE_TOKEN}
        try:
            await self._client.post(f"{self.endpoint.url}{path}", json=body, timeout=self.spec.stall_timeout_s)
        except httpx.TimeoutException:
            try:
                healthy = (await self._client.get(f"{self.endpoint.url}/health", timeout=2.0)).status_code == 200
            except httpx.HTTPError:
                healthy = False  # the server itself is stuck: Serve's health check judges that
            if healthy and self._hung is None:
                await self._mark_hung()
        except httpx.HTTPError:
            pass  # the engine answered, or the server is going away
        finally:
            self._probe = None

    async def _mark_hung(self) -> None:
        """The engine holds requests and has produced no token for ``stall_timeout_s``: fail the
        health check (Serve replaces the replica) and mark the endpoint record ``hung``, so the
        gateways stop picking it and retry its unanswered requests elsewhere."""
        self._hung = f"vLLM engine hung: no token generated or prefilled for {self.spec.stall_timeout_s:.0f}s"
        logger.error("%s (replica %s)", self._hung, self.replica)
        try:
            await asyncio.to_thread(self._publish)
        except Exception as exc:  # noqa: BLE001 - the failing health check still replaces it
            logger.warning("cannot mark the endpoint hung: %s", exc)

    async def _heartbeat_forever(self) -> None:
        """Every ``HEARTBEAT_S``: publish the endpoint record with the next sequence number, on its
        own task so that nothing but the store itself can delay it."""
        while True:
            try:
                await asyncio.to_thread(self._publish)
            except Exception as exc:  # noqa: BLE001 - gateways drop the record when it stays unchanged
                logger.warning("endpoint heartbeat failed: %s", exc)
            await asyncio.sleep(contract.HEARTBEAT_S)

    def _ensure_background(self) -> None:
        if not self._tasks:
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self._scrape_forever()), loop.create_task(self._heartbeat_forever())]
            if self.relay is not None:
                self._tasks.append(loop.create_task(self._start_relay()))

    async def _start_relay(self) -> None:
        """Serve the KV-block stream; the next heartbeat publishes its URL in the record."""
        assert self.relay is not None
        try:
            await self.relay.start(self.host, free_port(self.host))
            logger.info("KV-block stream of %s at %s", self.replica, self.relay.url)
        except Exception:  # noqa: BLE001 - without it the gateways route this replica by load only
            logger.exception("cannot serve the KV-block stream")

    def record_autoscaling_stats(self) -> dict[str, float]:
        """The engine's running + waiting requests: with direct routing Serve does not see the
        requests, and with leases the engine counts the same ones."""
        return {RUNNING_REQUESTS_KEY: self._load}

    def _wait_ready(self) -> None:
        what = f"vLLM for {self.spec.model}@{self.spec.version}"
        with httpx.Client(timeout=2.0) as client:

            def healthy() -> bool:
                if self.proc.poll() is not None:
                    code = self.proc.returncode
                    raise RuntimeError(self.output.reason(f"{what} exited with code {code} during start"))
                try:
                    return client.get(f"{self.endpoint.url}/health").status_code == 200
                except httpx.HTTPError:
                    return False

            try:
                ready = poll(healthy, self.spec.startup_timeout_s, 0.5)
            except BaseException:
                self._stop()  # what of its group still runs (an EngineCore) goes too
                raise
            if ready:
                self.output.started()
                return logger.info("%s ready", what)
        self._stop()
        raise TimeoutError(self.output.reason(f"{what} not ready after {self.spec.startup_timeout_s}s"))

    async def lease(self, hint: LeaseHint | None = None) -> AsyncIterator[Endpoint]:
        """Yield this replica's endpoint, then hold the lease open until the caller cancels."""
        if self.proc.poll() is not None:
            raise RuntimeError("vLLM engine process is not running")
        if self._hung:
            raise RuntimeError(self._hung)
        self._ensure_background()
        if hint is not None and hint.adapter:
            await self._register(hint.adapter)
        yield self.endpoint
        await asyncio.Event().wait()  # released by cancellation from the gateway

    async def _register(self, name: str) -> None:
        """The adapter registered with the engine before the request is sent here."""
        if self.adapters is None:
            raise RuntimeError(f"{self.spec.model}@{self.spec.version} serves no adapters (no LoRA slots)")
        await register(self.adapters, self._adapter, name)  # admitted before Serve evicts any for it

    async def ready(self) -> bool:
        return self.proc.poll() is None

    async def check_health(self) -> None:
        """Serve's health check: the engine process must live, answer /health, and make progress
        when it has work (:mod:`serving.replica.liveness`)."""
        self._ensure_background()
        if self.proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with code {self.proc.returncode}")
        if self._hung:
            raise RuntimeError(self._hung)
        resp = await self._client.get(f"{self.endpoint.url}/health")
        if resp.status_code != 200:
            raise RuntimeError(f"vLLM /health answered {resp.status_code}")

    def _stop(self) -> None:
        if (relay := getattr(self, "relay", None)) is not None:
            relay.close_sync()  # the engine's sockets go with it
        stop_engine(self.proc, hung=bool(getattr(self, "_hung", None)))
        lifeline = getattr(self, "_lifeline", None)
        if lifeline is not None:  # whatever of the engine is left is killed now
            self._lifeline = None
            os.close(lifeline)

    async def __del__(self) -> None:
        """Serve stops this replica (scale-down, promotion, shutdown): withdraw the endpoint, give
        the gateways time to stop picking it, let the requests they already sent finish (within
        the deployment's graceful_shutdown_timeout_s, less the time to stop vLLM), then stop vLLM."""
        deadline = time.monotonic() + self.spec.shutdown_grace_s - ENGINE_STOP_S - 2
        await asyncio.to_thread(self._stop_publishing)  # no heartbeat re-publishes the record from here on
        tasks: list[asyncio.Task[None]] = getattr(self, "_tasks", [])
        for task in tasks:
            task.cancel()
        kv, app = getattr(self, "_kv", None), getattr(self, "app", None)
        if kv is not None and app is not None:
            try:
                await asyncio.to_thread(contract.withdraw, kv, app, self.replica)
            except Exception as exc:  # noqa: BLE001 - gateways drop a record left stale anyway
                logger.warning("withdrawing %s: %s", self.replica, exc)
            if self.proc.poll() is None and not getattr(self, "_hung", None):  # a hung engine finishes nothing
                await asyncio.sleep(2 * contract.REFRESH_S + 0.5)  # gateways stop picking it
                while time.monotonic() < deadline and self.proc.poll() is None:
                    try:
                        if _engine_load(await self._engine_values()) == 0:
                            break
                    except Exception as exc:  # noqa: BLE001 - a slow scrape: its requests may still run
                        logger.warning("draining %s: %s", self.replica, exc)
                    await asyncio.sleep(0.5)
        self._stop()
        if (relay := getattr(self, "relay", None)) is not None:
            await relay.stop()


def build_model_server(args: dict[str, Any]) -> Any:
    """Serve application builder for one model version
    (``import_path: serving.replica.server:build_model_server``)."""
    from ray import serve

    return serve.deployment(name=args["name"])(ModelServer).bind(args["spec"])
