"""Liveness drills on the real stack: control-plane pauses and slow scrapes cut no healthy stream,
a hung engine is replaced without failing requests."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import psutil
import pytest

from serving.replica.engine import VLLM_SERVER_MODULE
from serving.replica.placement import engine_core_pid
from tests.conftest import Stack
from tests.integration.test_failover import _one, _replica_pids, _wait_replicas

pytestmark = pytest.mark.integration

APP = "adder--v1"


def _gcs_server_pid(stack: Stack) -> int:
    """The gcs_server of the test stack's Ray head: in the head's process group."""
    from serving.config import load_config
    from serving.control.stack import StackState

    state = StackState.load(load_config(stack.config).name)
    assert state is not None
    out = subprocess.run(["ps", "-eo", "pid,pgid,comm"], capture_output=True, text=True).stdout
    pids = [int(p) for p, g, comm in (line.split(None, 2) for line in out.splitlines()[1:]) if comm == "gcs_server"]
    mine = [p for p in pids if os.getpgid(p) == state.ray_pid]
    assert len(mine) == 1, (pids, state.ray_pid)
    return mine[0]


def _api_server_pid(replica_pid: int) -> int:
    """The vLLM OpenAI server a model replica started."""
    kids = [p for p in psutil.Process(replica_pid).children() if VLLM_SERVER_MODULE in p.cmdline()]
    assert len(kids) == 1, kids
    return kids[0].pid


def running_engines(app: str) -> list[tuple[int, int, int]]:
    """(replica pid, API server pid, EngineCore pid) of each replica of ``app`` with a running
    EngineCore. A replica that an earlier test's fault is still retiring can linger in the process
    list without its engine."""
    found = []
    for pid in _replica_pids(app):
        try:
            api = _api_server_pid(pid)
        except (AssertionError, psutil.Error):  # no API server (yet, or any more)
            continue
        core = engine_core_pid(api)
        if core is not None:
            found.append((pid, api, core))
    return found


def engine_victim(app: str) -> tuple[int, int]:
    """A replica of ``app`` with a running EngineCore, and that core's pid."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        found = running_engines(app)
        if found:
            pid, _, core = found[0]
            return pid, core
        time.sleep(2)
    raise AssertionError(f"no {app} replica with a running EngineCore")


@contextmanager
def _stopped(pid: int) -> Iterator[None]:
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _under_load(stack: Stack, clients: int, drill: Callable[[], None], streams: bool = True) -> list[tuple[str, str]]:
    """``clients`` loops of requests (all streams, or half streams) while ``drill`` runs in a thread,
    and for 3 s after it; returns (kind, outcome) of every request."""
    url = f"{stack.url}/v1/completions"

    async def run() -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        done = asyncio.Event()

        async with httpx.AsyncClient(timeout=120, headers=stack.headers()) as c:

            async def loop(k: int) -> None:
                i = k
                while not done.is_set():
                    out.append(await _one(c, url, 2 * i if streams else i))
                    i += clients

            tasks = [asyncio.create_task(loop(k)) for k in range(clients)]
            await asyncio.sleep(2)  # the load runs
            await asyncio.to_thread(drill)
            await asyncio.sleep(3)  # past the gateways' next reads of the endpoint store
            done.set()
            await asyncio.gather(*tasks)
        return out

    return asyncio.run(run())


def _no_request_fails_while_stopped(stack: Stack, pid: int, seconds: float) -> None:
    """Under 4 streaming clients, ``pid`` is stopped (SIGSTOP) for ``seconds``, then continued:
    every request, streams included, must finish ok."""

    def pause() -> None:
        with _stopped(pid):
            time.sleep(seconds)

    results = _under_load(stack, 4, pause)
    summary = Counter(f"{k}:{o}" for k, o in results)
    assert len(results) > 8 and all(o == "ok" for _, o in results), summary


def test_gcs_pause_cuts_no_stream(stack: Stack) -> None:
    """Ray's GCS stops for 20 s (the head's gcs_server SIGSTOPped) under streaming load: the
    heartbeats and the gateways' reads of the endpoint store stall with it, and no replica is
    taken for dead: every stream finishes, no request fails."""
    _wait_replicas(stack, APP, 2, 300)
    _no_request_fails_while_stopped(stack, _gcs_server_pid(stack), 20)


def test_slow_metrics_scrape_cuts_no_stream(stack: Stack) -> None:
    """One replica's vLLM server stops answering for 12 s (SIGSTOP), so its /metrics scrape runs
    past its 5 s timeout: the replica's heartbeat does not wait on the scrape, the gateways keep
    the replica, and its streams resume and finish."""
    _wait_replicas(stack, APP, 2, 300)
    _no_request_fails_while_stopped(stack, _api_server_pid(_replica_pids(APP)[0]), 12)


def test_hung_engine_is_replaced_and_its_requests_go_elsewhere(stack: Stack) -> None:
    """One of two replicas' EngineCore is SIGSTOPped under load: vLLM's /health still passes, but
    the replica sees work without progress (stall_timeout_s), fails its health check and marks its
    record hung; the gateways retry its unanswered requests on the other replica, and Serve
    replaces it."""
    _wait_replicas(stack, APP, 2, 300)
    victim, core = engine_victim(APP)

    def hang() -> None:
        os.kill(core, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 60
            while psutil.pid_exists(victim) and time.monotonic() < deadline:
                time.sleep(0.5)
        finally:
            try:
                os.kill(core, signal.SIGCONT)  # if it was not replaced (the test then fails)
            except ProcessLookupError:
                pass

    results = _under_load(stack, 6, hang, streams=False)
    summary = Counter(f"{k}:{o}" for k, o in results)
    assert not psutil.pid_exists(victim), "the hung replica was not stopped"
    # every non-streamed request, and every stream that had not started on the hung replica, was answered
    assert all(o == "ok" for k, o in results if k == "plain"), summary
    # a stream already running on the hung replica ends with an error event, never silently
    assert all(o in ("ok", "error-event") for k, o in results if k == "stream"), summary
    assert sum(o == "ok" for _, o in results) >= len(results) - 6, summary
    _wait_replicas(stack, APP, 2, 300)


def test_the_engine_does_not_inherit_the_tenants_keys(stack: Stack) -> None:
    """The replica has the tenants' key_env variables (the gateway reads them); its vLLM server not."""
    from serving.config import load_config

    key_envs = {t.key_env for t in load_config(stack.config).auth.tenants if t.key_env}
    assert key_envs
    _wait_replicas(stack, APP, 2, 300)
    for replica in _replica_pids(APP):
        assert key_envs <= set(psutil.Process(replica).environ()), "the check needs the keys in the replica"
        environ = psutil.Process(_api_server_pid(replica)).environ()
        assert environ.get("VLLM_CPU_KVCACHE_SPACE")  # it is the engine's environment
        assert not key_envs & set(environ), replica


def _roll_gateway(stack: Stack, retries: int) -> None:
    """Redeploy the stack with other gateway args: Serve replaces every gateway replica (new ones
    start first, old ones drain); returns once only new replicas run."""
    from serving.config import load_config
    from serving.control.serve_config import build_serve_config
    from serving.control.stack import StackState, deploy

    cfg = load_config(stack.config)
    state = StackState.load(cfg.name)
    assert state is not None
    old = set(_replica_pids("gateway"))
    assert len(old) == cfg.gateway.num_replicas, old
    changed = cfg.model_copy(update={"gateway": cfg.gateway.model_copy(update={"retries": retries})})
    # seed: the promotion controller keeps its args (a changed one restarts and re-applies the record)
    deploy(state, build_serve_config(changed, stack.config.parent, seed=cfg))
    deadline = time.monotonic() + 120
    while True:
        now = set(_replica_pids("gateway"))
        if len(now) == cfg.gateway.num_replicas and not now & old:  # the old ones drained and exited
            return
        assert time.monotonic() < deadline, (old, now)
        time.sleep(1)


def test_gateway_replicas_replaced_under_load_lose_no_request(stack: Stack) -> None:
    """Serve replaces both gateway replicas (a changed setting) under load, and back: each old
    replica fails readiness, keeps serving for shutdown.notice_s with connection: close, then
    drains; clients on new and kept-alive connections see no failure."""
    from serving.config import load_config

    _wait_replicas(stack, APP, 2, 300)
    retries = load_config(stack.config).gateway.retries

    def roll() -> None:
        try:
            _roll_gateway(stack, retries + 1)
        finally:
            _roll_gateway(stack, retries)

    results = _under_load(stack, 4, roll, streams=False)
    summary = Counter(f"{k}:{o}" for k, o in results)
    assert len(results) > 8 and all(o == "ok" for _, o in results), summary
