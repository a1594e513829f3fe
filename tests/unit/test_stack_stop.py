"""`serving down`'s last step on real processes: the raylet alone gets SIGTERM (a real raylet
whose GCS is gone retries it for some 10 s before it exits), and once it has exited the rest of
the Ray head's process group gets SIGKILL."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest


def test_stop_kills_what_lingers_once_the_raylet_is_gone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from serving.control import stack

    monkeypatch.setattr(stack, "RUN_DIR", tmp_path)
    # a stand-in head: a "raylet" that takes 2 s to exit on SIGTERM, a "gcs_server" that notes
    # a SIGTERM in a file (it must get none: the raylet unregisters from it first)
    name = "import ctypes, signal, sys, time; ctypes.CDLL(None).prctl(15, sys.argv[1].encode(), 0, 0, 0); "
    raylet = name + "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(2), sys.exit(0))); time.sleep(300)"
    noted = tmp_path / "gcs-got-sigterm"
    gcs = name + f"signal.signal(signal.SIGTERM, lambda *_: open({str(noted)!r}, 'w').close()); time.sleep(300)"
    head = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"subprocess.Popen([sys.executable, '-c', {raylet!r}, 'raylet'])\n"
        f"subprocess.Popen([sys.executable, '-c', {gcs!r}, 'gcs_server'])\n"
        "time.sleep(300)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", head], start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while stack._group_commands(proc.pid) != {"python", "raylet", "gcs_server"}:
            assert time.monotonic() < deadline, stack._group_commands(proc.pid)
            time.sleep(0.05)
        # port 9 (discard): the dashboard does not answer, so no Serve app is deleted
        stack.StackState("t", proc.pid, 1, 9, str(tmp_path), "http://127.0.0.1:9").save()
        t0 = time.monotonic()
        assert stack.stop_stack("t", log=lambda _: None)
        assert 2 <= time.monotonic() - t0 < 15  # the raylet's own exit, not the 30 s cap
        proc.wait(timeout=5)
        assert stack._group_commands(proc.pid) == set()
        assert not noted.exists()  # the GCS stayed up until the raylet was gone
        assert stack.StackState.load("t") is None
    finally:
        subprocess.run(["pkill", "-KILL", "-g", str(proc.pid)], check=False)
