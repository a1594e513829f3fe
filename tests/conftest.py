"""Shared fixtures. The integration stack is started once per session through the README's own
command (`serving up`) and stopped with `serving down`; set SERVING_REUSE_STACK=1 to reuse a stack
you already started with the same config (then it is left running)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVING = str(Path(sys.executable).with_name("serving"))


def _run(args: list[str], timeout: float) -> None:
    subprocess.run([SERVING, *args], cwd=ROOT, check=True, timeout=timeout)


@pytest.fixture(scope="session")
def stack_config() -> Path:
    return ROOT / "tests" / "integration" / "stack.yaml"


@pytest.fixture(scope="session")
def base_url(stack_config: Path) -> Iterator[str]:
    from serving.config import load_config

    cfg = load_config(stack_config)
    url = f"http://{cfg.gateway.host}:{cfg.gateway.port}"
    reuse = os.environ.get("SERVING_REUSE_STACK") == "1"
    try:
        if not reuse:
            _run(["up", "-c", str(stack_config)], timeout=2400)
        yield url
    finally:
        if not reuse:
            _run(["down", "-c", str(stack_config)], timeout=300)
