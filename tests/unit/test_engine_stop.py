"""Stopping a replica's engine: the whole process group goes, also when its leader (vLLM's API
server) died alone; and a stopping replica drains through a failed scrape instead of cutting its
requests (real processes; the replica's drain with its engine's metrics scripted)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from serving import contract
from serving.replica.engine_stop import stop_engine
from serving.replica.server import ModelServer

# a group leader that forks a child (an EngineCore) and prints its pid; both sleep; with "stubborn",
# both ignore SIGTERM
GROUP = """
import os, signal, sys, time
if sys.argv[1] == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = os.fork()
if child == 0:
    time.sleep(600)
    os._exit(0)
print(child, flush=True)
time.sleep(600)
"""


def _group(kind: str = "plain") -> tuple[subprocess.Popen[bytes], int]:
    proc = subprocess.Popen([sys.executable, "-c", GROUP, kind], stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper is dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def _gone(pid: int, within_s: float = 5.0) -> bool:
    end = time.monotonic() + within_s
    while _alive(pid) and time.monotonic() < end:
        time.sleep(0.05)
    return not _alive(pid)


def test_the_engine_core_of_an_api_server_that_died_alone_is_killed() -> None:
    proc, child = _group()
    try:
        os.kill(proc.pid, signal.SIGKILL)  # the API server crashes; its EngineCore does not notice
        proc.wait(timeout=10)
        assert _alive(child)
        stop_engine(proc, hung=False)
        assert _gone(child)
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize("hung", [True, False])
def test_an_engine_that_ignores_sigterm_is_killed(hung: bool) -> None:
    proc, child = _group("stubborn")
    started = time.monotonic()
    stop_engine(proc, hung=hung, stop_s=1.0)
    assert proc.poll() is not None and _gone(child)
    assert time.monotonic() - started < (1.0 if hung else 5.0)  # a hung engine gets no SIGTERM grace


class _Stopping(ModelServer):
    """A replica built by hand; Python's own ``__del__`` at garbage collection does nothing."""

    def __del__(self) -> None:
        pass


class _KV:
    def __init__(self) -> None:
        self.deleted: list[str] = []

    def delete(self, key: str) -> None:
        self.deleted.append(key)


def test_a_stopping_replica_drains_through_a_failed_metrics_scrape(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's /metrics times out once during the drain: the replica keeps waiting for its
    requests (load 2, then 0) before it stops vLLM, instead of stopping it at the first error."""
    monkeypatch.setattr(contract, "REFRESH_S", 0.0)
    proc, child = _group()
    server: Any = object.__new__(_Stopping)
    loads: list[Any] = [TimeoutError("scrape timed out"), 2.0, 0.0]
    seen: list[Any] = []

    async def values() -> dict[str, float]:
        seen.append((loads[0], proc.poll()))
        item = loads.pop(0)
        if isinstance(item, Exception):
            raise item
        return {"vllm:num_requests_running": item}

    server.spec = type("Spec", (), {"shutdown_grace_s": 60.0})()
    server.proc, server.relay, server._lifeline, server._hung = proc, None, None, None
    server._kv, server.app, server.replica, server._tasks = _KV(), "m--v1", "r1", []
    server._engine_values = values
    try:
        asyncio.run(ModelServer.__del__(server))
        assert [load for load, _ in seen] == [seen[0][0], 2.0, 0.0]
        assert all(code is None for _, code in seen)  # vLLM ran until the load was 0
        assert server._draining and server._kv.deleted and proc.poll() is not None and _gone(child)
    finally:
        stop_engine(proc, hung=True)
