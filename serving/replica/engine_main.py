"""The engine's launcher: ``python -m serving.replica.engine_main FD MODULE ARGS...`` runs vLLM's
server ``MODULE`` with ``ARGS`` and kills the engine's whole process group (API server and
``EngineCore``) the moment the replica process that started it dies, however it dies.

Why not ``PR_SET_PDEATHSIG`` with SIGTERM: that starts vLLM's graceful shutdown, and a dead replica
is a crash, not a stop. vLLM stops its engine first and its HTTP server after, and a request that
arrives in between gets a 500 (``cannot schedule new futures after shutdown``) while ``/health``
still answers 200, so the gateway takes the 500 for the engine's own answer to that request and
passes it on (docs/operations.md, "When a model replica dies"). Killed at once, the engine fails
the way a crash does: connections reset or are refused, which the gateway retries on another
replica (no byte sent yet) or continues there (stream migration). A replica that stops normally
still stops vLLM with SIGTERM, after draining (``ModelServer._stop``).

How: the replica keeps the write end of a pipe and passes the read end as ``FD``. The kernel
closes the write end when the replica exits, by SIGKILL too; a thread here blocks reading ``FD``
and on end-of-file sends SIGKILL to its own process group (the replica starts the engine in a
session of its own). Imports nothing from vLLM before it runs ``MODULE``.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading

__all__ = ["LAUNCHER", "guarded", "kill_group_when_closed"]

LAUNCHER = "serving.replica.engine_main"


def guarded(read_fd: int, server: list[str]) -> list[str]:
    """Arguments after ``python`` that run ``server`` (``-m MODULE ARGS...``, as
    :func:`serving.replica.engine.vllm_command` gives them) under this launcher."""
    flag, module, *args = server
    if flag != "-m":
        raise ValueError(f"expected '-m MODULE ...', got {server[:2]}")
    return ["-m", LAUNCHER, str(read_fd), module, *args]


def kill_group_when_closed(read_fd: int) -> threading.Thread:
    """Start the thread that SIGKILLs this process group once ``read_fd`` reads end-of-file. Only
    a group this process leads (a session of its own): never the group of a shell that ran it."""

    def watch() -> None:
        try:
            while os.read(read_fd, 1):
                pass
        except OSError:
            pass
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)
        else:
            os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="replica-death-watch", daemon=True)
    thread.start()
    return thread


def main(argv: list[str]) -> None:
    read_fd, module, *args = argv
    kill_group_when_closed(int(read_fd))
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
