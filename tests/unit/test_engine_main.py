"""The engine launcher kills the engine's whole process group when the replica that started it
dies by SIGKILL, and leaves it running while the replica lives."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from serving.replica.engine_main import guarded
from serving.replica.placement import proc_stat
from serving.waiting import poll, wait_until
from tests.conftest import ROOT

# The "server": forks a child (as vLLM forks EngineCore), both write their pid and sleep.
SERVER = """
import os, sys, time
out = sys.argv[1]
if os.fork() == 0:
    open(out + ".child", "w").write(str(os.getpid()))
else:
    open(out + ".server", "w").write(str(os.getpid()))
time.sleep(600)
"""

# The "replica": starts the server under the launcher in a session of its own, as ModelServer does.
REPLICA = """
import os, subprocess, sys, time
from serving.replica.engine_main import guarded
read_fd, lifeline = os.pipe()
cmd = [sys.executable, *guarded(read_fd, ["-m", "fake_engine", sys.argv[1]])]
subprocess.Popen(cmd, start_new_session=True, pass_fds=(read_fd,))
os.close(read_fd)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    """Whether the process runs; a zombie (nobody reaped it yet) is dead too."""
    stat = proc_stat(Path(f"/proc/{pid}"))
    return stat is not None and stat[1][0] != "Z"


def _pid(path: Path) -> int:
    return int(wait_until(lambda: path.exists() and path.read_text(), 30, 0.05, f"{path} not written"))


@pytest.fixture
def fake_engine(tmp_path: Path) -> Iterator[tuple[dict[str, str], Path]]:
    """The environment that finds ``fake_engine`` and the prefix of its pid files; whatever of
    it is left is killed afterwards."""
    (tmp_path / "fake_engine.py").write_text(SERVER)
    out = tmp_path / "pid"
    yield {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}, out
    for name in ("server", "child"):
        p = Path(f"{out}.{name}")
        if p.exists() and p.read_text():
            try:
                os.kill(int(p.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_guarded_runs_the_module_under_the_launcher() -> None:
    assert guarded(7, ["-m", "vllm.x", "--model", "m"]) == [
        "-m",
        "serving.replica.engine_main",
        "7",
        "vllm.x",
        "--model",
        "m",
    ]
    with pytest.raises(ValueError):
        guarded(7, ["-c", "print()"])


def test_engine_group_dies_with_its_replica(fake_engine: tuple[dict[str, str], Path]) -> None:
    env, out = fake_engine
    replica = subprocess.Popen([sys.executable, "-c", REPLICA, str(out)], env=env)
    try:
        server, child = _pid(Path(f"{out}.server")), _pid(Path(f"{out}.child"))
        time.sleep(0.5)
        assert _alive(server) and _alive(child), "the engine must run while its replica lives"
        replica.send_signal(signal.SIGKILL)
        replica.wait(timeout=10)
        assert poll(lambda: not _alive(server) and not _alive(child), 10, 0.05), "the engine outlived its replica"
    finally:
        replica.kill()


# A "shell" that runs the launcher in its own process group (no session of the launcher's own),
# then closes the pipe: the launcher must die alone, the shell must live on.
SHELL = """
import os, subprocess, sys, time
from serving.replica.engine_main import guarded
read_fd, lifeline = os.pipe()
cmd = [sys.executable, *guarded(read_fd, ["-m", "fake_engine", sys.argv[1]])]
launcher = subprocess.Popen(cmd, pass_fds=(read_fd,), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
os.close(read_fd)
while not os.path.exists(sys.argv[1] + ".server"):
    time.sleep(0.05)
os.close(lifeline)
print("launcher exit", launcher.wait(timeout=10), flush=True)
"""


def test_a_launcher_in_a_shared_group_kills_only_itself(fake_engine: tuple[dict[str, str], Path]) -> None:
    env, out = fake_engine
    # a session of its own, so that a launcher that wrongly kills its group cannot reach pytest
    shell = subprocess.run(
        [sys.executable, "-c", SHELL, str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=True,
    )
    assert shell.returncode == 0, shell.stderr
    assert shell.stdout.strip() == f"launcher exit {-signal.SIGKILL}"
