"""Local stack lifecycle: build missing models (:mod:`serving.control.build`), start a local Ray
head, deploy, wait, stop.

The local Ray head is started as ``ray start --head --block`` in its own process group, with its
dashboard and job API on 127.0.0.1 only and Ray's token authentication on (``RAY_AUTH_MODE=token``,
a fresh random token per stack in ``.run/<stack>.token``, mode 0600). Its pid is written to
``.run/<stack>.json`` so ``serving down`` stops exactly what ``serving up`` started.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from serving.config import LOCAL_RAY_LOOPBACK, ConfigError, LocalRayConfig, StackConfig
from serving.control.build import check_version_layout, ensure_models, only_models, servable
from serving.control.serve_config import build_serve_config
from serving.replica.placement import pid_alive, proc_stat
from serving.waiting import poll, wait_until

__all__ = [
    "StackState",
    "deploy",
    "ray_env",
    "serve_status",
    "start_ray",
    "stop_stack",
    "up",
    "wait_http",
    "wait_running",
]

RUN_DIR = Path(os.environ.get("SERVING_RUN_DIR", ".run"))


@dataclass
class StackState:
    name: str
    ray_pid: int
    gcs_port: int
    dashboard_port: int
    temp_dir: str
    base_url: str

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    @property
    def token_path(self) -> Path:
        return token_path(self.name)

    def auth(self) -> dict[str, str]:
        """Header for the dashboard / job API (Ray token authentication)."""
        if not self.token_path.exists():
            return {}
        return {"authorization": f"Bearer {self.token_path.read_text().strip()}"}

    def save(self) -> Path:
        RUN_DIR.mkdir(parents=True, exist_ok=True)
        path = RUN_DIR / f"{self.name}.json"
        path.write_text(json.dumps(asdict(self), indent=2))
        return path

    @classmethod
    def load(cls, name: str) -> StackState | None:
        path = RUN_DIR / f"{name}.json"
        return cls(**json.loads(path.read_text())) if path.exists() else None


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a listener, not TIME_WAIT, means busy
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def token_path(name: str) -> Path:
    """Stack ``name``'s Ray token file (mode 0600, written by :func:`start_ray`)."""
    return (RUN_DIR / f"{name}.token").resolve()


def ray_env(name: str) -> dict[str, str]:
    """The environment of every process of stack ``name``'s Ray, its head's and any driver's:
    Ray's token authentication with the stack's token file, and ``LOCAL_RAY_LOOPBACK``. A driver
    without the latter resolves ``127.0.0.1`` to the machine's network address, where this head
    does not listen, and ``ray.init`` waits until it times out."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path(name)), **LOCAL_RAY_LOOPBACK}


def start_ray(
    name: str, ray: LocalRayConfig, env: dict[str, str], base_url: str, ports: tuple[int, ...] = ()
) -> StackState:
    """Start (or reuse) this stack's local Ray head; ``ports`` must be free for a new one (the
    gateway binds its port with SO_REUSEPORT, so a second stack on it would not fail by itself)."""
    state = StackState.load(name)
    if state and pid_alive(state.ray_pid):
        return state
    busy = [p for p in ports if not _port_free(p)]
    if busy:
        raise RuntimeError(
            f"port(s) {busy} of stack '{name}' are in use; stop what holds them "
            "or change gateway.port / local_ray ports"
        )
    temp_dir = f"/tmp/raystack-{name}"
    ray_bin = str(Path(sys.executable).with_name("ray"))
    cmd = [
        ray_bin,
        "start",
        "--head",
        "--block",
        "--node-ip-address",
        "127.0.0.1",
        "--port",
        str(ray.gcs_port),
        "--num-cpus",
        str(ray.num_cpus),
        "--dashboard-host",
        "127.0.0.1",
        "--dashboard-port",
        str(ray.dashboard_port),
        "--metrics-export-port",
        str(ray.metrics_export_port),
        "--temp-dir",
        temp_dir,
        "--disable-usage-stats",
    ]
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    token = token_path(name)
    token.touch(mode=0o600)
    token.write_text(secrets.token_hex(32))
    # Ray starts workers at nice 15, below its own daemons; the engines are the product, so they
    # run at normal priority unless the environment says otherwise (docs/performance.md)
    nice = {"RAY_worker_niceness": "0"}
    # Serve's controller reconciles every 0.1 s, idle or not (with its GCS calls ~0.04 of a core on
    # the 2-core box); a longer period saves some of that, but a promotion's last route change
    # then reaches the gateway after `serving promote` returned (tests/e2e/test_promotion.py)
    loop = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": f"{ray.serve_control_loop_s:g}"}
    log = open(RUN_DIR / f"{name}-ray.log", "ab")
    proc = subprocess.Popen(
        cmd,
        env={**nice, **os.environ, **env, **loop, **ray_env(name)},
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    state = StackState(name, proc.pid, ray.gcs_port, ray.dashboard_port, temp_dir, base_url)
    state.save()

    def up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {proc.returncode}; see {RUN_DIR}/{name}-ray.log")
        try:
            return httpx.get(f"{state.dashboard}/api/version", headers=state.auth(), timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, 120, 1, "the local Ray head did not come up")
    return state


def deploy(state: StackState, serve_config: dict[str, Any]) -> None:
    """Apply a Serve config declaratively (what ``serve deploy`` and KubeRay do)."""
    resp = httpx.put(f"{state.dashboard}/api/serve/applications/", json=serve_config, headers=state.auth(), timeout=60)
    if resp.status_code >= 400:
        raise RuntimeError(f"Serve rejected the config ({resp.status_code}): {resp.text[:2000]}")


def serve_status(state: StackState) -> dict[str, Any]:
    resp = httpx.get(f"{state.dashboard}/api/serve/applications/", headers=state.auth(), timeout=30)
    resp.raise_for_status()
    return dict(resp.json())


def wait_running(state: StackState, apps: list[str], timeout_s: float, log: Any = print) -> None:
    """Wait until every named Serve application is RUNNING; fail fast on DEPLOY_FAILED."""
    last = [""]

    def running() -> bool:
        try:
            details = serve_status(state).get("applications", {})
        except httpx.HTTPError:  # a busy dashboard on 2 cores can be slow to answer
            return False
        statuses = {a: details.get(a, {}).get("status", "MISSING") for a in apps}
        line = ", ".join(f"{a}={s}" for a, s in sorted(statuses.items()))
        if line != last[0]:
            log(f"  {line}")
            last[0] = line
        failed = [a for a, s in statuses.items() if s in ("DEPLOY_FAILED", "UNHEALTHY")]
        if failed:
            raise RuntimeError(f"application {failed[0]} failed: {_failure(details[failed[0]])}")
        return all(s == "RUNNING" for s in statuses.values())

    if not poll(running, timeout_s, 1):
        raise TimeoutError(f"applications not RUNNING after {timeout_s:.0f}s: {last[0]}")


def _failure(app: dict[str, Any]) -> str:
    """The application's message and its failed deployments' (Serve puts the replica's exception,
    e.g. which checkpoint file was refused, only in the latter), each cut to its last 1500
    characters: the exception's own line ends a traceback."""
    parts = [str(app.get("message", ""))] + [
        f"{name}: {d['message']}"
        for name, d in app.get("deployments", {}).items()
        if d.get("status") in ("DEPLOY_FAILED", "UNHEALTHY") and d.get("message")
    ]
    return "\n".join(p if len(p) <= 1500 else "..." + p[-1500:] for p in parts if p)


def wait_http(base_url: str, timeout_s: float = 60) -> None:

    def ready() -> bool:
        try:
            return httpx.get(f"{base_url}/ready", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(ready, timeout_s, 0.25, f"{base_url}/ready did not answer 200")


def _group_processes(pgid: int, proc: Path = Path("/proc")) -> dict[int, str] | None:
    """The live processes of process group ``pgid`` (zombies left out): pid -> command name
    (comm); None without /proc (not Linux)."""
    if not proc.is_dir():
        return None
    found = {}
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        stat = proc_stat(d)
        if stat is not None and stat[1][0] != "Z" and int(stat[1][2]) == pgid:
            found[int(d.name)] = stat[0]
    return found


def _group_commands(pgid: int, proc: Path = Path("/proc")) -> set[str]:
    """The command names of the live processes of process group ``pgid``. Without /proc the group
    counts as still running its raylet."""
    found = _group_processes(pgid, proc)
    return {"raylet"} if found is None else set(found.values())


def stop_stack(name: str, log: Any = print) -> bool:
    """Delete the Serve apps, then stop the Ray head's process group. True if anything ran."""
    state = StackState.load(name)
    if state is None:
        return False
    if pid_alive(state.ray_pid):
        try:
            httpx.delete(f"{state.dashboard}/api/serve/applications/", headers=state.auth(), timeout=60)
            poll(lambda: not serve_status(state).get("applications"), 60, 1)
        except httpx.HTTPError:
            pass
        # SIGTERM to the raylet alone: it stops its workers, unregisters from the GCS and exits
        # within a second. With the GCS signalled too it retries the dead GCS for some 10 s
        # first. What is left then (the GCS, the dashboard, the log monitor, `ray start
        # --block`) holds nothing a stopped local head needs, so it gets SIGKILL at once.
        try:
            found = _group_processes(state.ray_pid)
            if found is None:  # no /proc to find the raylet by: the whole group
                os.killpg(state.ray_pid, signal.SIGTERM)
            for pid in [p for p, name in (found or {}).items() if name == "raylet"]:
                with contextlib.suppress(ProcessLookupError):  # exited since: the group still gets SIGKILL
                    os.kill(pid, signal.SIGTERM)
            poll(lambda: not pid_alive(state.ray_pid) or "raylet" not in _group_commands(state.ray_pid), 30, 0.1)
            os.killpg(state.ray_pid, signal.SIGKILL)
            poll(lambda: not pid_alive(state.ray_pid), 5, 0.2)
        except ProcessLookupError:
            pass
    (RUN_DIR / f"{name}.json").unlink(missing_ok=True)
    state.token_path.unlink(missing_ok=True)  # Ray's logs stay in state.temp_dir for debugging
    log(f"stopped stack {name!r} (ray head pid {state.ray_pid})")
    return True


def check_exposure(cfg: StackConfig) -> None:
    """Refuse a gateway without API keys (``auth.mode: open``) on an address other machines reach."""
    host = cfg.gateway.host
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: what it resolves to is not known here
        loopback = False
    if cfg.auth.mode == "open" and not loopback:
        raise ConfigError(
            f"gateway.host is {host!r} with auth.mode 'open': every model would answer anyone who "
            "reaches this machine without a key; listen on 127.0.0.1, or use auth.mode keys"
        )


def up(
    cfg: StackConfig,
    base: Path,
    env: dict[str, str],
    timeout_s: float,
    log: Any = print,
    seed: StackConfig | None = None,
    early: bool = True,
) -> StackState:
    """Start the stack ``cfg`` (the live versions applied); ``seed`` is the config as written,
    which the promotion controller application gets. With ``early``, while models still train,
    each one that is built is deployed at once (the Ray head starts with the first), so it
    answers before the last training job ends; the full config is deployed after."""
    check_exposure(cfg)
    base_url = f"http://{cfg.gateway.host}:{cfg.gateway.port}"
    g, r = cfg.gateway, cfg.local_ray
    ports = (g.port, g.serve_proxy_port, r.gcs_port, r.dashboard_port, r.metrics_export_port)
    head: StackState | None = None
    served: set[str] = set()

    def ray_head() -> StackState:
        nonlocal head
        if head is None:
            head = start_ray(cfg.name, r, env, base_url, ports)
            log(f"ray head up (pid {head.ray_pid}, dashboard {head.dashboard}, loopback only)")
        return head

    def serve_what_is_built() -> None:
        names = servable(cfg, base)
        part = only_models(cfg, names) if names - served else None
        if part is None:
            return
        try:  # a path-only model is checked after the last job; a bad layout waits for that error
            for m in part.models:
                for v in m.versions:
                    check_version_layout(part, m, v, base)
        except (ValueError, OSError):
            return
        part_seed = only_models(seed, names) if seed is not None else None
        deploy(ray_head(), build_serve_config(part, base, read_manifests=True, seed=part_seed))
        served.update(names)
        log(f"deploying {', '.join(sorted(names))} at {base_url}/v1 while the other models train")

    ensure_models(cfg, base, log, on_built=serve_what_is_built if early else None)
    state = ray_head()
    serve_config = build_serve_config(cfg, base, read_manifests=True, seed=seed)
    deploy(state, serve_config)
    wait_running(state, [a["name"] for a in serve_config["applications"]], timeout_s, log)
    wait_http(base_url)
    return state
