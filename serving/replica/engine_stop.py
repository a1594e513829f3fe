"""Stopping a replica's vLLM process group (the API server, its session leader, and its EngineCore).

vLLM's EngineCore does not watch its parent: an API server that died alone (killed, crashed)
leaves it running, holding its memory, its cores and, on a GPU, the device. The group outlives its
leader, so the whole group is signalled, also when the leader is gone. (The lifeline of
:mod:`serving.replica.engine_main` covers the replica dying; this covers the engine's own leader.)
"""

from __future__ import annotations

import os
import signal
import subprocess

__all__ = ["ENGINE_STOP_S", "stop_engine"]

ENGINE_STOP_S = 10.0  # SIGTERM to SIGKILL when vLLM is stopped


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:  # the group is gone
        pass


def stop_engine(proc: subprocess.Popen[bytes], hung: bool, stop_s: float = ENGINE_STOP_S) -> None:
    """Stop the process group that ``proc`` (started with ``start_new_session``) leads: SIGTERM,
    then SIGKILL after ``stop_s``; at once SIGKILL when the engine is ``hung`` (a stopped or stuck
    engine would not act on SIGTERM). Whatever is left of the group after its leader exited
    (an EngineCore whose API server died alone) is killed too."""
    if proc.poll() is None and hung:
        _signal_group(proc.pid, signal.SIGKILL)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=stop_s)
        except subprocess.TimeoutExpired:
            pass
    # the leader is reaped above, so its pid names only its group for as long as that has members
    _signal_group(proc.pid, signal.SIGKILL)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # in uninterruptible I/O: it dies when that returns
        pass
