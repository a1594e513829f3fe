"""How long the suite's set-up steps take (training the default models, imports, each stack's
``serving up`` and ``serving down``), printed after the run by ``pytest_terminal_summary`` in
tests/conftest.py, so the CI budget stays visible beside ``--durations``."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["PHASES", "job_log", "phase"]

PHASES: list[tuple[str, float]] = []  # (what, seconds), in the order they ended


@contextmanager
def phase(what: str) -> Iterator[None]:
    start = time.monotonic()
    try:
        yield
    finally:
        PHASES.append((what, time.monotonic() - start))


@contextmanager
def job_log(what: str) -> Iterator[Callable[[str], None]]:
    """A ``log`` for :func:`serving.control.build.ensure_models` that times each training job:
    each ``building ...`` line it prints starts a phase that the next one (or the end) closes."""
    current: list[tuple[str, float]] = []

    def close() -> None:
        if current:
            name, start = current.pop()
            PHASES.append((name, time.monotonic() - start))

    def log(line: str) -> None:
        print(line)
        if line.startswith("building "):
            close()
            current.append((f"{what}: {line.removeprefix('building ').split(' with ')[0]}", time.monotonic()))

    try:
        yield log
    finally:
        close()
