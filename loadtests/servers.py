"""The servers the benchmark compares, each started and stopped by the benchmark itself.

- ``bare``: vLLM's own OpenAI server (``python -m vllm.entrypoints.launchers.api_server.entry``), with the
  command line our model replicas use (:func:`serving.replica.engine.vllm_command`), so the engine
  arguments are the same by construction (on CPU with one rank that includes the single-process
  executor, :func:`serving.replica.engine.single_process`).
- ``bare-mp``: the same with vLLM's own CPU default, the multiprocess executor (a separate worker
  process): what a user of vLLM gets without that tuning.
- ``rayllm``: stock ``ray.serve.llm.build_openai_app`` on a private local Ray
  (:mod:`loadtests.rayllm_app`), the same engine arguments as ``engine_kwargs``.
- ``ours``: this project's stack through ``serving up`` / ``serving down`` with a generated stack
  config (auth open) pointing at the same model directory; the gateway replicas serve the port
  themselves (``gateway.ingress: listener``) and pick model replicas themselves
  (``gateway.replica_routing: direct``), the defaults.
- ``ours-lease``: the same with one Serve lease call per request (``replica_routing: serve``, the
  design before direct replica routing).
- ``ours-proxy``: the same behind Ray Serve's HTTP proxy as well (``gateway.ingress: serve_proxy``,
  the design before the listener). These two are the comparison points of docs/performance.md.
- ``*-ha``: the same with ``RAY_SERVE_ENABLE_HA_PROXY=1 RAY_SERVE_ENABLE_DIRECT_INGRESS=1`` in the
  environment of Ray (Ray Serve's HAProxy ingress mode); without the suffix both are removed.
  ``ours-ha`` uses Serve's ingress (``serve_proxy``), which HAProxy mode replaces.

Every process is started in a new session and stopped by its process group, then any process
left in that session is killed by pid: nothing else on the machine is touched (no ``ray stop``).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from serving.config import EngineConfig, LoraSlots
from serving.replica.engine import OFFLINE_ENV, EngineSpec, engine_args, single_process, vllm_command, vllm_env
from serving.replica.placement import EnginePinning, claim_cores, engine_core_pid
from serving.waiting import poll

__all__ = ["HA_ENV", "KINDS", "BenchModel", "Server", "make_server", "running", "session_pids", "stop_session"]

ROOT = Path(__file__).resolve().parents[1]
HA_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"}
HAPROXY_DIR = Path("/tmp/haproxy-serve")  # Ray's HAProxy working files; it leaves them behind
KINDS = ("bare", "bare-mp", "rayllm", "rayllm-ha", "ours", "ours-lease", "ours-proxy", "ours-ha")


@dataclass(frozen=True)
class BenchModel:
    """The one model every server serves, with one set of engine arguments."""

    path: str
    engine: EngineConfig
    use_gpu: bool = False
    name: str = "bench"
    lora: LoraSlots | None = None  # a base of adapters: vLLM's LoRA flags and runtime registration

    def engine_kwargs(self) -> dict[str, Any]:
        """The engine arguments ``vllm_command`` passes, for ``LLMConfig.engine_kwargs``."""
        return dict(engine_args(self.spec()))

    def spec(self) -> EngineSpec:
        return EngineSpec(
            model=self.name,
            version="v1",
            path=self.path,
            engine=self.engine,
            use_gpu=self.use_gpu,
            gpus_per_rank=1.0 if self.use_gpu else 0.0,
            lora=self.lora,
        )


def _base_env(ha: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in HA_ENV and k != "RAY_ADDRESS"}
    env.update(OFFLINE_ENV)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return {**env, **HA_ENV} if ha else env


def _haproxy_dirs() -> set[str]:
    return {p.name for p in HAPROXY_DIR.iterdir()} if HAPROXY_DIR.is_dir() else set()


def _cmdlines() -> str:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                out.append((d / "cmdline").read_bytes().decode("utf-8", "replace"))
            except OSError:
                continue
    return "\n".join(out)


def session_pids(sid: int) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.getsid(int(d.name)) == sid:
                    pids.append(int(d.name))
            except (ProcessLookupError, PermissionError):
                continue
    return pids


def stop_session(proc: subprocess.Popen[bytes], grace_s: float = 30) -> None:
    """SIGTERM the process (it may clean up), then its group, then every process left in its session."""
    sid = proc.pid
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(sid, sig)
        except ProcessLookupError:
            break
        time.sleep(2)
    for pid in session_pids(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        proc.wait(10)


@dataclass
class Server:
    kind: str
    model: BenchModel
    log_dir: Path
    port: int
    base_url: str = ""
    api_key: str | None = None
    stack: dict[str, Any] = field(default_factory=dict)  # ours: stack config overrides
    proc: subprocess.Popen[bytes] | None = None
    config_path: Path | None = None
    temp_dir: str = ""  # rayllm: its private Ray's temp dir (short: Ray's socket paths)
    haproxy_before: set[str] = field(default_factory=set)

    @property
    def ha(self) -> bool:
        return self.kind.endswith("-ha")

    def start(self, timeout_s: float = 900) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.haproxy_before = _haproxy_dirs()
        getattr(self, f"_start_{self.kind.split('-')[0]}")(timeout_s)
        wait_serving(self.base_url, self.api_key, self.model.name, timeout_s, self.proc)
        if self.kind == "bare":
            self.pin_like_ours()

    def pin_like_ours(self) -> None:
        """The placement our model server gives a single-process CPU engine (``ModelServer._pin``),
        so that bare vLLM runs the same engine deployment as ours: EngineCore on a core of its
        own, the API server on the others. Call it again once a second engine has claimed a core:
        ours re-applies it as engines come and go."""
        spec = self.model.spec()
        if self.proc is None or not (spec.engine.pin_cores and single_process(spec)):
            return
        engine = engine_core_pid(self.proc.pid)
        if engine is None:
            return
        cores = claim_cores(max(1, int(spec.cpus_per_rank)), self.proc.pid)
        spare = EnginePinning(self.proc.pid, engine, cores).apply()
        if spare:
            print(f"  bare: EngineCore {engine} on cores {cores}, API server on {spare}", flush=True)
        else:  # as ours: with every core claimed, nothing is pinned (placement.pin_single_process)
            print(f"  bare: every core is claimed; EngineCore {engine} and its API server unpinned", flush=True)

    def stop(self) -> None:
        if self.kind.startswith("ours"):
            if self.config_path is not None:
                subprocess.run(
                    [_serving_bin(), "down", "-c", str(self.config_path)],
                    cwd=ROOT,
                    env=_base_env(self.ha),
                    timeout=300,
                    check=False,
                )
        elif self.proc is not None:
            stop_session(self.proc)
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        if self.ha:
            in_use = _cmdlines()
            for d in _haproxy_dirs() - self.haproxy_before:
                if d not in in_use:  # never the files of a HAProxy that still runs (someone else's)
                    shutil.rmtree(HAPROXY_DIR / d, ignore_errors=True)
        if self.model.use_gpu:
            wait_gpu_released()

    def _log(self) -> Any:
        return open(self.log_dir / f"{self.kind}.log", "ab")

    def _start_bare(self, timeout_s: float) -> None:
        spec = self.model.spec()
        if self.kind == "bare-mp":
            extra = {**spec.engine.extra_args, "distributed-executor-backend": "mp"}
            spec = spec.model_copy(update={"engine": spec.engine.model_copy(update={"extra_args": extra})})
        self.api_key = self.api_key or secrets.token_urlsafe(16)  # engines behind one router share one
        cmd = [sys.executable, *vllm_command(spec, "127.0.0.1", self.port)]
        with self._log() as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                cmd,
                env={**_base_env(False), **vllm_env(spec, token=self.api_key)},
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        self.base_url = f"http://127.0.0.1:{self.port}"

    def _start_rayllm(self, timeout_s: float) -> None:
        import json

        spec = self.model.spec()
        cmd = [
            sys.executable,
            "-m",
            "loadtests.rayllm_app",
            "--model-dir",
            self.model.path,
            "--model-id",
            self.model.name,
            "--port",
            str(self.port),
            "--engine",
            json.dumps(self.model.engine_kwargs()),
        ]
        self.temp_dir = f"/tmp/rb-{secrets.token_hex(3)}"
        cmd += ["--temp-dir", self.temp_dir]
        if self.model.use_gpu:
            cmd.append("--gpu")
        with self._log() as log:
            self.proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env={**_base_env(self.ha), **vllm_env(spec)},
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        self.base_url = f"http://127.0.0.1:{self.port}"

    def _start_ours(self, timeout_s: float) -> None:
        ingress = "listener" if self.kind in ("ours", "ours-lease") else "serve_proxy"
        routing = "direct" if self.kind == "ours" else "serve"
        cfg = our_stack_config(self.model, self.port, ingress=ingress, replica_routing=routing, **self.stack)
        self.config_path = (self.log_dir / f"stack-{cfg['name']}.yaml").resolve()  # serving runs in ROOT
        self.config_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [_serving_bin(), "up", "-c", str(self.config_path), "--timeout", str(int(timeout_s))]
        with self._log() as log:
            done = subprocess.run(
                cmd, cwd=ROOT, env=_base_env(self.ha), stdout=log, stderr=log, timeout=timeout_s + 120
            )
        if done.returncode != 0:
            raise RuntimeError(f"serving up failed ({done.returncode}); see {self.log_dir / (self.kind + '.log')}")


def wait_gpu_released(timeout_s: float = 180) -> None:
    """Until no process holds GPU memory (the next server needs all of it); engines exit late."""
    pids: list[str] = []

    def released() -> bool:
        cmd = ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"]
        pids[:] = subprocess.run(cmd, capture_output=True, text=True, check=False).stdout.split()
        return not pids

    if not poll(released, timeout_s, 3):
        raise TimeoutError(f"GPU still in use after {timeout_s:.0f}s: pids {pids}")


def _serving_bin() -> str:
    return str(Path(sys.executable).with_name("serving"))


def our_stack_config(
    model: BenchModel,
    port: int,
    replicas: int = 1,
    router: str = "power_of_two",
    ingress: str = "listener",
    replica_routing: str = "direct",
    name: str = "bench",
    gcs_port: int = 6393,
    dashboard_port: int = 8278,
    metrics_export_port: int = 8088,
    gateway: dict[str, Any] | None = None,
    adapters: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A stack config serving only ``model`` (auth open), on ports apart from the default stacks;
    ``gateway``: further ``gateway:`` fields (e.g. ``{"max_migrations": 0}``); ``adapters``: LoRA
    adapters of ``model`` (name: version folder, served as ``v1``), with ``model.lora``'s slots."""
    base: dict[str, Any] = {
        "name": model.name,
        "versions": [{"version": "v1", "path": model.path}],
        "engine": model.engine.model_dump(mode="json"),
        "deployment": {
            "num_replicas": replicas,
            "max_ongoing_requests": 256,
            "max_queued_requests": 1024,
            "router": router,
            "gpus_per_rank": 1.0 if model.use_gpu else 0.0,
        },
    }
    if model.lora is not None:
        base["lora"] = model.lora.model_dump(mode="json")
    served = [base] + [
        {"name": name, "base": model.name, "versions": [{"version": "v1", "path": path}]}
        for name, path in (adapters or {}).items()
    ]
    return {
        "name": name,
        "gateway": {
            "host": "127.0.0.1",
            "port": port,
            "num_replicas": 1,
            "ingress": ingress,
            "replica_routing": replica_routing,
            **(gateway or {}),
        },
        "local_ray": {
            "gcs_port": gcs_port,
            "dashboard_port": dashboard_port,
            "metrics_export_port": metrics_export_port,
            "num_cpus": 8,
        },
        "auth": {"mode": "open"},
        "models": served,
    }


def wait_serving(
    base_url: str, api_key: str | None, model: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None
) -> None:
    """Until one small completion succeeds (an engine can list models before it can generate)."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"model": model, "prompt": "hello", "max_tokens": 2}
    last = [""]

    def serving() -> bool:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server process exited with {proc.returncode} while starting")
        try:
            r = httpx.post(f"{base_url}/v1/completions", json=body, headers=headers, timeout=30)
        except httpx.HTTPError as exc:
            last[0] = type(exc).__name__
            return False
        last[0] = f"{r.status_code} {r.text[:200]}"
        return r.status_code == 200

    if not poll(serving, timeout_s, 2):
        raise TimeoutError(f"{base_url} not serving after {timeout_s:.0f}s (last: {last[0]})")


def make_server(kind: str, model: BenchModel, log_dir: Path, **stack: Any) -> Server:
    if kind not in KINDS:
        raise ValueError(f"unknown server {kind!r} (known: {', '.join(KINDS)})")
    port = {"bare": 8031, "bare-mp": 8031, "rayllm": 8032, "rayllm-ha": 8032}.get(kind, 8021)
    return Server(kind, model, log_dir, port, stack=stack)


@contextmanager
def running(server: Server, timeout_s: float = 900) -> Iterator[Server]:
    """Start ``server``; always stop it, even when starting failed half-way."""
    try:
        server.start(timeout_s)
        yield server
    finally:
        server.stop()
