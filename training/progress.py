"""One progress display per training job, drawn by the driver from what rank 0 posts.

Why an actor: Ray Train's ``report()`` is for checkpoints and goes through the controller, which
logs every call; calling it each step only to show a loss made the terminal a wall of internal
lines. Rank 0 instead posts ``(step, loss, lr)`` to a tiny actor (no CPU reserved) every few
steps, and a driver thread polls it and draws a ``rich`` bar on a terminal, or prints a plain
line every tenth of the run when the output is a file or a CI log.
"""

from __future__ import annotations

import threading
from typing import Any

import ray

__all__ = ["ProgressBoard", "ProgressPrinter"]


class ProgressBoard:
    """The latest progress of one job (a Ray actor, see :func:`ProgressPrinter.start`)."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}

    def post(self, state: dict[str, Any]) -> None:
        self.state = state

    def get(self) -> dict[str, Any]:
        return self.state


class ProgressPrinter:
    """Polls a :class:`ProgressBoard` actor and shows the job's progress until :meth:`stop`."""

    def __init__(self, label: str, total: int, interval_s: float = 0.5):
        self.label = label
        self.total = total
        self.interval_s = interval_s
        self.board: Any = ray.remote(num_cpus=0)(ProgressBoard).remote()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="training-progress", daemon=True)

    def start(self) -> ProgressPrinter:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        ray.kill(self.board)

    def _poll(self) -> dict[str, Any]:
        try:
            return dict(ray.get(self.board.get.remote(), timeout=5))
        except Exception:  # the actor or Ray is going away at the end of the job
            return {}

    def _run(self) -> None:
        from rich.console import Console

        console = Console(stderr=True)
        if console.is_terminal:
            self._run_bar(console)
        else:
            self._run_lines()

    def _run_bar(self, console: Any) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TimeRemainingColumn(),
        )
        with Progress(*columns, console=console, transient=False) as bar:
            task = bar.add_task(self.label, total=self.total, loss="-")
            while not self._stop.wait(self.interval_s):
                state = self._poll()
                if "step" in state:
                    bar.update(task, completed=state["step"], loss=f"{state['loss']:.4f}")
            state = self._poll()
            if "step" in state:
                bar.update(task, completed=state["step"], loss=f"{state['loss']:.4f}")

    def _run_lines(self) -> None:
        every = max(1, self.total // 10)
        shown = -1
        while not self._stop.wait(self.interval_s):
            state = self._poll()
            step = int(state.get("step", 0))
            if step and step // every != shown // every:
                shown = step
                eta = float(state.get("eta_s", float("nan")))
                print(
                    f"[{self.label}] step {step}/{self.total} loss {state['loss']:.4f} "
                    f"lr {state['lr']:.2e} eta {eta:.0f}s",
                    flush=True,
                )
