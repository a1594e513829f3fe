"""An engine that cannot start says why: the replica's start failure (what Serve reports and
``serving up`` prints) ends with vLLM's own last lines, and every line still reaches the replica's
log. The first test starts the real vLLM server (outside Serve, with the replica's own command and
launcher); it refuses an engine argument's value and exits."""

from __future__ import annotations

import io
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import serving.replica.server as server
from serving.config import EngineConfig
from serving.replica.engine import EngineSpec
from serving.replica.engine_output import EngineOutput
from serving.waiting import wait_until


def test_a_failed_engine_start_ends_with_vllms_own_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = EngineConfig(max_model_len=256, dtype="float32", extra_args={"max-num-batched-tokens": "lots"})
    spec = EngineSpec(model="m", version="v9", path=str(tmp_path), engine=engine, startup_timeout_s=120)
    monkeypatch.setattr(server, "verified_spec", lambda s: s)  # no weights needed: vLLM stops at its arguments
    # no claim in the node's core ledger: it is held by the claiming pid, this test session, and
    # later engines of the session (tests/e2e/test_bench.py) would find a core taken
    monkeypatch.setattr(server, "engine_cores", lambda s: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # Serve awaits __del__; here nobody does
        with pytest.raises(RuntimeError) as failed:
            server.ModelServer(spec.model_dump())
    message = str(failed.value)
    assert message.startswith("vLLM for m@v9 exited with code 2 during start; its last output:\n"), message
    assert message.endswith("argument --max-num-batched-tokens: invalid human_readable_int value: 'lots'"), message
    assert len(message) < 1500  # serving up shows a failed deployment's last 1500 characters


PRINTER = """
import sys
for i in range(30):
    print(f"line {i}", flush=True)
print("x" * 1000, file=sys.stderr, flush=True)
sys.stdin.readline()
print("after ready", flush=True)
"""


def test_every_line_reaches_the_log_and_only_the_start_is_kept() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", PRINTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    sink = io.StringIO()
    output = EngineOutput(proc.stdout, sink, keep=3)
    assert proc.stdin is not None
    try:
        wait_until(lambda: "x" * 1000 in sink.getvalue(), 30, 0.05, "the printer's lines did not arrive")
        assert output.tail(wait_s=0) == "line 28\nline 29\n" + "x" * 300 + "..."  # the last 3, cut
        output.started()
        proc.stdin.write(b"\n")
        proc.stdin.close()
        assert proc.wait(30) == 0
        assert output.tail(wait_s=10) == ""  # nothing kept once ready: a request's text never is
        lines = sink.getvalue().splitlines()
        assert lines[:30] == [f"line {i}" for i in range(30)] and lines[-1] == "after ready"
        assert lines[30] == "x" * 1000  # the log gets the whole line, the kept tail a cut one
    finally:
        proc.kill()
        proc.wait()


def test_a_kept_line_is_cut_and_a_silent_engine_is_named() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "print('y' * 1000)"], stdout=subprocess.PIPE)
    output = EngineOutput(proc.stdout, io.StringIO())
    proc.wait(30)
    assert output.reason("vLLM exited") == "vLLM exited; its last output:\n" + "y" * 300 + "..."
    silent = subprocess.Popen([sys.executable, "-c", "pass"], stdout=subprocess.PIPE)
    quiet = EngineOutput(silent.stdout, io.StringIO())
    silent.wait(30)
    assert quiet.reason("vLLM exited") == "vLLM exited (it wrote nothing)"


def test_a_replica_built_outside_ray_starts_no_ray_of_its_own() -> None:
    """``node_ip`` outside Ray is loopback; asking Ray for its nodes there would start a local Ray
    instance (its dashboard on 8265, its agent on 52365) that lives as long as the process."""
    probe = "from serving.replica.node import node_ip; import ray; print(node_ip(), ray.is_initialized())"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["127.0.0.1", "False"], out.stdout + out.stderr
