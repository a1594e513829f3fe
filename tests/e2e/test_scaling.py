"""Per-model autoscaling, scale-to-zero and tensor parallelism on the real stack (issue 5)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import Stack, running_stack

pytestmark = pytest.mark.e2e

CONFIG = Path(__file__).with_name("scaling-stack.yaml")


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with running_stack(CONFIG) as s:
        yield s


def _running(stack: Stack, states: tuple[str, ...] = ("RUNNING",)) -> dict[str, int]:
    """Replicas per application in the given states (as Serve reports them)."""
    from serving.config import load_config
    from serving.control.stack import StackState, serve_status

    state = StackState.load(load_config(stack.config).name)
    assert state is not None
    apps = serve_status(state)["applications"]
    return {
        name: sum(r.get("state") in states for d in a["deployments"].values() for r in d.get("replicas", []))
        for name, a in apps.items()
    }


def _complete(stack: Stack, model: str, prompt: str, timeout: float = 60) -> httpx.Response:
    return httpx.post(
        f"{stack.url}/v1/completions",
        timeout=timeout,
        json={"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0},
    )


def test_tensor_parallel_2_matches_tp_1(stack: Stack) -> None:
    prompts = [f"{a}+{b}=" for a, b in [(12, 30), (7, 5), (45, 37), (60, 21), (9, 9), (33, 44)]]
    tp1 = [_complete(stack, "scaler", p).json()["choices"][0]["text"] for p in prompts]
    tp2 = [_complete(stack, "tp2", p).json()["choices"][0]["text"] for p in prompts]
    assert tp1 == tp2


def test_scale_to_zero_model_answers_after_cold_start(stack: Stack) -> None:
    assert _running(stack)["cold--v1"] == 0
    started = time.monotonic()
    r = _complete(stack, "cold", "12+30=", timeout=400)
    assert r.status_code == 200, r.text
    # the same checkpoint as scaler: the same greedy answer
    assert r.json()["choices"][0]["text"] == _complete(stack, "scaler", "12+30=").json()["choices"][0]["text"]
    assert _running(stack)["cold--v1"] == 1
    print(f"cold start answered after {time.monotonic() - started:.0f}s")


def test_one_model_scales_up_and_back_the_other_stays(stack: Stack) -> None:
    """The scaler model and the gateway (which counts the requests its own listener serves) both
    scale 1 -> 2 under a load step and back to 1 after it; tp2 never moves."""
    before = _running(stack)
    assert before["scaler--v1"] == 1 and before["gateway"] == 1
    tp2_before = before["tp2--v1"]
    answer = _complete(stack, "scaler", "12+30=").json()["choices"][0]["text"]
    stop = threading.Event()

    async def load() -> tuple[int, list[str]]:
        async with httpx.AsyncClient(timeout=120) as c:

            async def worker() -> tuple[int, list[str]]:
                ok, failed = 0, []
                while not stop.is_set():
                    r = await c.post(
                        f"{stack.url}/v1/completions",
                        json={"model": "scaler", "prompt": "12+30=", "max_tokens": 40, "ignore_eos": True},
                    )
                    if r.status_code == 200:
                        ok += 1
                    else:
                        failed.append(f"{r.status_code} {r.text[:200]}")
                return ok, failed

            done = await asyncio.gather(*(worker() for _ in range(8)))
            return sum(d[0] for d in done), [f for d in done for f in d[1]]

    result: list[tuple[int, list[str]]] = []
    t = threading.Thread(target=lambda: result.append(asyncio.run(load())))
    t.start()
    starting = ("STARTING", "UPDATING", "RUNNING")
    try:
        # load until the autoscaler added a model replica and a gateway replica (any state); then
        # stop the load, so that on 2 cores the new engine is not starved while it starts
        deadline, decided = time.monotonic() + 180, False
        while time.monotonic() < deadline and not decided:
            time.sleep(2)
            counts = _running(stack, starting)
            decided = counts["scaler--v1"] >= 2 and counts["gateway"] >= 2
            assert counts["tp2--v1"] == tp2_before  # scaling one model never moves another
    finally:
        stop.set()
        t.join(timeout=180)
    assert decided, f"the autoscaler did not add a scaler and a gateway replica under load: {_running(stack, starting)}"
    ok, failed = result[0]
    assert ok > 0 and failed == [], failed[:5]
    deadline, peak = time.monotonic() + 420, 1
    while time.monotonic() < deadline and peak < 2:
        time.sleep(3)
        peak = max(peak, _running(stack)["scaler--v1"])
    assert peak == 2, "the second replica never became RUNNING"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and (_running(stack)["scaler--v1"] > 1 or _running(stack)["gateway"] > 1):
        time.sleep(3)
    counts = _running(stack)
    assert counts["scaler--v1"] == 1, "scaler did not scale back to its minimum"
    assert counts["gateway"] == 1, "the gateway did not scale back to its minimum"
    assert counts["tp2--v1"] == tp2_before
    r = _complete(stack, "scaler", "12+30=")  # still served after both scaled in
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == answer
