"""The promotion controller as a Ray Serve application (``promotion-controller``, one replica).

Why a Serve application rather than a detached actor: it is declared in the same Serve config as
every other app, so ``serving up`` deploys it and KubeRay deploys it from ``serveConfigV2`` with
no extra step, on a new cluster too (blue/green); Serve restarts its replica when it dies or fails
its health check (the loop thread stopped); and its args (the stack config as written, never the
live versions) do not change when a step is applied, so applying a step never restarts it.
Exactly one replica per cluster; across clusters the store lock (``serving.record``)
leaves only one of them active.

Each poll the replica runs :meth:`Controller.tick`. Locally a step is applied through Serve's own
controller (what ``serve deploy`` and the dashboard call); on Kubernetes as a patch of the
RayService's ``serveConfigV2`` (:mod:`serving.control.k8s_apply`).
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import fsspec
import httpx
from ray import serve

from serving.config import StackConfig
from serving.control.controller import Controller
from serving.control.serve_config import build_serve_config
from serving.lease import StoreLock, holder_name
from serving.manifest import Manifest
from serving.record import ControlStore
from serving.registry import CheckpointStore

__all__ = ["HttpProber", "PromotionController", "ServeApplier", "build_controller"]

logger = logging.getLogger("raystack.promotion")


class ServeApplier:
    """Applies configs to the Serve instance this replica runs in; reads every node's metrics."""

    def __init__(self, seed: StackConfig, base: Path | None) -> None:
        self.seed, self.base = seed, base

    @staticmethod
    def _client() -> Any:
        from ray.serve.context import _get_global_client

        client = _get_global_client()
        if client is None:
            raise RuntimeError("no Serve controller to talk to")
        return client

    def apply(self, cfg: StackConfig) -> None:
        from ray.serve.schema import ServeDeploySchema

        # the manifests' creation times, as `serving up` deploys them (what /v1/models shows)
        config = build_serve_config(cfg, self.base, read_manifests=True, seed=self.seed)
        self._client().deploy_apps(ServeDeploySchema.model_validate(config))

    def app_status(self, app: str) -> tuple[str, str]:
        details = self._client().get_serve_details().get("applications", {}).get(app)
        if details is None:
            return "MISSING", ""
        messages = [str(details.get("message", ""))] + [
            str(d.get("message", "")) for d in details.get("deployments", {}).values()
        ]
        status = details.get("status")
        return str(getattr(status, "value", status)), "\n".join(m for m in messages if m)

    def metrics_by_node(self) -> dict[str, str | None]:
        import ray

        texts: dict[str, str | None] = {}
        for node in ray.nodes():
            if not node.get("Alive") or not node.get("MetricsExportPort"):
                continue
            url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
            key = str(node.get("NodeID") or url)
            try:
                r = httpx.get(url, timeout=10)
                r.raise_for_status()
            except httpx.HTTPError as exc:  # a window with a node not read at both ends passes nothing
                logger.warning("metrics of %s not read: %s", url, exc)
                texts[key] = None
                continue
            texts[key] = r.text
        return texts


def _normalise(text: str) -> str:
    return " ".join(text.split())


class HttpProber:
    """Warm-up and online-eval requests to ``model@version`` through the gateway (``client``: an
    ``httpx.Client``, whose transport a test may script)."""

    def __init__(self, base_url: str, headers: dict[str, str], client: httpx.Client | None = None) -> None:
        self.base_url, self.headers = base_url.rstrip("/"), headers
        self.client = client or httpx.Client(timeout=120)

    def warm(self, model: str, version: str, n: int, pooling: bool = False, first_within_s: float = 30) -> None:
        """``n`` requests (embeddings for a pooling model) that must all answer 200; the first may
        wait ``first_within_s`` for the gateways to learn the new app's replicas (its RUNNING can
        precede that)."""
        path, body = "/v1/completions", {"model": f"{model}@{version}", "prompt": "1+1=", "max_tokens": 2}
        if pooling:
            path, body = "/v1/embeddings", {"model": f"{model}@{version}", "input": "1+1="}
        deadline = time.monotonic() + first_within_s
        for i in range(n):
            while True:
                r = self.client.post(f"{self.base_url}{path}", json=body, headers=self.headers, timeout=120)
                if r.status_code == 200:
                    break
                if i > 0 or time.monotonic() > deadline:
                    raise RuntimeError(f"warm-up request answered {r.status_code}")
                time.sleep(2)

    def online_eval(self, model: str, version: str, manifest: Manifest, n: int) -> float | None:
        """Exact match on a random sample of the manifest's eval rows, greedy, answers compared
        whitespace-insensitively with the reference (as the training job scores them). None: no
        eval rows (none named, or not readable), distinct from an eval whose requests fail (misses)."""
        uri = manifest.eval.data.uri if manifest.eval and manifest.eval.data else None
        if not uri or "#" in uri:
            return None
        try:
            with fsspec.open(uri, "rb") as fh:
                rows = [json.loads(line) for line in fh.read().decode().splitlines() if line.strip()]
        except (OSError, ValueError) as exc:
            logger.warning("online eval of %s@%s: eval rows at %s not read: %s", model, version, uri, exc)
            return None
        rows = random.Random(time.time_ns()).sample(rows, min(n, len(rows)))
        return self.exact_match(f"{model}@{version}", rows)

    def exact_match(self, model: str, rows: list[dict[str, Any]], workers: int = 1) -> float | None:
        """The share of ``rows`` (training-format eval rows) that ``model`` answers exactly, on
        ``workers`` concurrent requests; a request that fails (an error status, a timeout) is a
        miss. None when no row can be scored (tool-call answers are not)."""
        with ThreadPoolExecutor(workers) as pool:
            hits = list(pool.map(lambda row: self._ask(model, row), rows))
        scored = [h for h in hits if h is not None]
        return sum(scored) / len(scored) if scored else None

    def _ask(self, model: str, row: dict[str, Any]) -> bool | None:
        question = _question(model, row)
        if question is None:
            return None
        path, body, reference = question
        try:
            r = self.client.post(f"{self.base_url}{path}", json=body, headers=self.headers, timeout=120)
            r.raise_for_status()
            choice = r.json()["choices"][0]
            answer = choice["text"] if "prompt" in body else choice["message"].get("content") or ""
        except (httpx.HTTPError, ValueError, LookupError, TypeError, AttributeError) as exc:
            logger.warning("online eval request to %s failed, counted as a miss: %s", model, exc)
            return False
        return _normalise(str(answer)) == _normalise(reference)


def _question(model: str, row: dict[str, Any]) -> tuple[str, dict[str, Any], str] | None:
    """The request (path, body) that asks ``row``'s question, and its reference answer; None for a
    row that is not scored online (a tool-call answer)."""
    if "prompt" in row and "completion" in row:
        reference = str(row["completion"])
        body = {"model": model, "prompt": row["prompt"], "max_tokens": _room(reference), "temperature": 0}
        return "/v1/completions", body, reference
    messages = row.get("messages") or []
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
    if last < 0 or not isinstance(messages[last].get("content"), str):
        return None
    reference = messages[last]["content"]
    body = {"model": model, "messages": messages[:last], "max_tokens": _room(reference), "temperature": 0}
    return "/v1/chat/completions", body, reference


def _room(reference: str) -> int:
    """Tokens to generate for an answer to compare with ``reference``: its UTF-8 bytes (a
    byte-level token holds at least one) and a few more, as the training job's eval gives."""
    return max(32, len(reference.encode()) + 8)


def build_controller(cfg: StackConfig, base: Path | None, observe: Any = None) -> Controller:
    """The controller of a stack, wired for the cluster it runs in."""
    import os

    root = cfg.store_root(base)
    control = ControlStore(root, cfg.name)
    lock = StoreLock(control.lease, holder_name(), cfg.controller.lock_ttl_s)
    if cfg.controller.target == "kubernetes":
        from serving.control.k8s_apply import RayServiceApplier

        applier: Any = RayServiceApplier(cfg, ServeApplier(cfg, base))
    else:
        applier = ServeApplier(cfg, base)
    host = cfg.gateway.host if cfg.gateway.host not in ("0.0.0.0", "::") else "127.0.0.1"
    url = cfg.controller.gateway_url or f"http://{host}:{cfg.gateway.port}"
    key_env = cfg.controller.client_key_env
    headers = {"authorization": f"Bearer {os.environ[key_env]}"} if key_env and os.environ.get(key_env) else {}
    kwargs = {"observe": observe} if observe else {}
    prober = HttpProber(url, headers)
    return Controller(cfg, CheckpointStore(root), control, lock, applier, prober, base=base, **kwargs)


class PromotionController:
    """One replica: a thread that runs :meth:`Controller.tick` every ``controller.poll_s``."""

    def __init__(self, config: dict[str, Any], base: str | None) -> None:
        from serving.metrics import ControllerMetrics

        self.cfg = StackConfig.model_validate(config)
        # decisions go to the replica's own log file, beside Serve's lines
        logger.setLevel(logging.INFO)
        for handler in logging.getLogger("ray.serve").handlers:
            logger.addHandler(handler)
        self.metrics = ControllerMetrics()
        self.controller = build_controller(self.cfg, Path(base) if base else None, self.metrics.observe)
        self.state = "starting"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="promotion-controller", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.state = self.controller.tick()
            except Exception:  # a store or Serve hiccup: the next poll tries again
                logger.exception("promotion controller tick failed")
            self.metrics.active(self.state == "active")
            self._stop.wait(self.cfg.controller.poll_s)

    def check_health(self) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("the promotion controller's loop stopped")

    async def __call__(self, request: Any) -> dict[str, Any]:
        return {"state": self.state}

    def __del__(self) -> None:
        self._stop.set()


def build_promotion_controller(args: dict[str, Any]) -> Any:
    """``import_path`` target of the ``promotion-controller`` application."""
    deployment = serve.deployment(name="PromotionController", max_ongoing_requests=4)(PromotionController)
    return deployment.bind(args["config"], args.get("base"))
