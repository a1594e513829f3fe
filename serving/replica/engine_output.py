"""An engine's console output: passed on to the replica's log, its last lines kept while it starts.

vLLM says why it cannot start (an engine argument it refuses, a model it cannot load, memory it
cannot get) on its console, and then only exits. The replica reads that console through a pipe,
writes every line on to its own stderr (Ray's replica log, where the lines went before), and keeps
the last few lines until the engine is ready, so the start failure that Serve reports (and
``serving up`` prints) carries vLLM's own reason. Nothing is kept once the engine is ready: the
kept lines never hold a request.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from typing import IO

__all__ = ["EngineOutput"]

KEEP_LINES = 12  # the end of a Python traceback and the line that says what went wrong
LINE_CHARS = 300


class EngineOutput:
    """Pumps ``stream`` (the engine's stdout and stderr, one pipe) into ``sink`` on a daemon
    thread until the engine closes it."""

    def __init__(self, stream: IO[bytes] | None, sink: IO[str] | None = None, keep: int = KEEP_LINES) -> None:
        self._sink = sink if sink is not None else sys.stderr
        self._lines: deque[str] = deque(maxlen=keep)
        self._keeping = True
        self._thread = threading.Thread(target=self._pump, args=(stream,), name="engine-output", daemon=True)
        self._thread.start()

    def _pump(self, stream: IO[bytes] | None) -> None:
        if stream is None:  # the engine's output was not piped
            return
        try:
            for raw in iter(stream.readline, b""):
                line = raw.decode("utf-8", "replace")
                try:
                    self._sink.write(line)
                    self._sink.flush()
                except (OSError, ValueError):  # a closed sink must not stop the engine's pipe draining
                    pass
                text = line.rstrip()
                if self._keeping and text:
                    self._lines.append(text if len(text) <= LINE_CHARS else text[:LINE_CHARS] + "...")
        finally:
            stream.close()

    def started(self) -> None:
        """The engine is ready: keep nothing from here on."""
        self._keeping = False
        self._lines.clear()

    def tail(self, wait_s: float = 2.0) -> str:
        """The last lines kept, after waiting up to ``wait_s`` for the engine's last writes (its
        pipe closes when every process of the engine has exited)."""
        self._thread.join(wait_s)
        return "\n".join(self._lines)

    def reason(self, what: str) -> str:
        """``what`` followed by the engine's last lines, for a start failure's message."""
        tail = self.tail()
        return f"{what}; its last output:\n{tail}" if tail else f"{what} (it wrote nothing)"
