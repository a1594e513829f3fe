"""Stream migration on the real stack (issue 22): one of the two ``adder`` replicas' EngineCore is
SIGKILLed while six clients stream 64-token greedy answers (completions and chat). Every stream
must complete, with 64 tokens, one role chunk (chat), one ``[DONE]`` and no error event, and its
text must equal the same request's uninterrupted answer: the streams that were on the killed
engine were continued on the other replica. The gateways count it in
``raystack_stream_migrations``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from typing import Any

import httpx
import psutil
import pytest

from serving.config import load_config
from serving.metrics import samples
from tests.conftest import Stack
from tests.integration.raytools import endpoint_records
from tests.integration.test_failover import _replica_pids, _wait_replicas
from tests.integration.test_liveness import running_engines

pytestmark = pytest.mark.integration

APP = "adder--v1"
CLIENTS, ROUNDS, TOKENS = 6, 2, 64
USAGE = {"include_usage": True}


def _request(i: int) -> tuple[str, dict[str, Any]]:
    """Client ``i``'s request: completions for even clients, chat for odd ones; greedy, 64 tokens."""
    common = {"model": "adder", "max_tokens": TOKENS, "ignore_eos": True, "temperature": 0}
    a, b = 10 + 7 * i, 3 + 5 * i
    if i % 2 == 0:
        return "/v1/completions", {**common, "prompt": f"{a}+{b}="}
    return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": f"What is {a}+{b}?"}]}


def _text(chunk: dict[str, Any]) -> str:
    c = chunk["choices"][0]
    return str(c.get("text") or (c.get("delta") or {}).get("content") or "")


async def _stream(c: httpx.AsyncClient, url: str, i: int, seen: list[int]) -> dict[str, Any]:
    """One streamed request; ``seen[i]`` counts its text chunks as they arrive."""
    path, body = _request(i)
    async with c.stream("POST", url + path, json={**body, "stream": True, "stream_options": USAGE}) as r:
        assert r.status_code == 200, await r.aread()
        raw = ""
        async for text in r.aiter_text():
            raw += text
            seen[i] = raw.count('"index":0')
    events = [e for e in raw.split("\n\n") if e]
    chunks = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
    usage = [ch["usage"] for ch in chunks if not ch["choices"] and ch.get("usage")]
    roles = sum(1 for ch in chunks if ch["choices"] and (ch["choices"][0].get("delta") or {}).get("role"))
    return {
        "done": events.count("data: [DONE]") == 1 and events[-1] == "data: [DONE]",
        "error": any('"error"' in e for e in events),
        "text": "".join(_text(ch) for ch in chunks if ch["choices"]),
        "tokens": usage[-1]["completion_tokens"] if usage else None,
        "roles": roles,
        "ids": len({ch["id"] for ch in chunks}),
    }


def _migrations(stack: Stack) -> float:
    """``raystack_stream_migrations`` resumed for adder, from the Ray metrics-export port."""
    port = load_config(stack.config).local_ray.metrics_export_port
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(
        v
        for name, labels, v in samples(text, "raystack_stream_migrations")
        if labels.get("model") == "adder" and labels.get("outcome") == "resumed"
    )


def _engines(stack: Stack) -> list[tuple[int, int, str, str]]:
    """(replica pid, EngineCore pid, engine url, engine token) of each ``adder`` replica with a
    running engine, matched to its endpoint record by the port its API server listens on."""
    by_port = {int(r["url"].rsplit(":", 1)[1]): r for r in endpoint_records(stack, APP)}
    engines = []
    for pid, api, core in running_engines(APP):
        try:
            ports = {c.laddr.port for c in psutil.Process(api).net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        except psutil.Error:  # it stopped since
            continue
        record = next((by_port[p] for p in ports if p in by_port), None)
        if record is not None:
            engines.append((pid, core, record["url"], record["token"]))
    return engines


async def _running(c: httpx.AsyncClient, url: str, token: str) -> float:
    """The requests an engine is running now (its own gauge)."""
    r = await c.get(f"{url}/metrics", headers={"authorization": f"Bearer {token}"})
    return sum(v for _, _, v in samples(r.text, "vllm:num_requests_running"))


def test_streams_on_a_killed_engine_continue_on_the_other_replica(stack: Stack) -> None:
    _wait_replicas(stack, APP, 2, 300)
    before = _migrations(stack)
    deadline = time.monotonic() + 120
    while len(engines := _engines(stack)) < 2:
        assert time.monotonic() < deadline, f"two adder engines with endpoint records: {engines}"
        time.sleep(2)
    killed: list[int] = []

    async def run() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        async with httpx.AsyncClient(timeout=300, headers=stack.headers()) as c:
            # the uninterrupted answers, one request at a time
            reference = [await _stream(c, stack.url, i, [0] * CLIENTS) for i in range(CLIENTS)]
            seen = [0] * CLIENTS

            async def client(i: int) -> list[dict[str, Any]]:
                return [await _stream(c, stack.url, i, seen) for _ in range(ROUNDS)]

            tasks = [asyncio.create_task(client(i)) for i in range(CLIENTS)]
            while min(seen) < 8:  # every client's first stream is under way
                await asyncio.sleep(0.01)
            # Both engines are held where they are while their API servers are asked what they
            # run: a short stream of the tiny model can end within one /metrics scrape.
            for _, core, _, _ in engines:
                os.kill(core, signal.SIGSTOP)
            try:
                async with httpx.AsyncClient(timeout=10) as probe:
                    running = await asyncio.gather(*(_running(probe, url, token) for _, _, url, token in engines))
                assert max(running) > 0, f"no adder engine runs a stream: {running}"
                victim, core, _, _ = engines[running.index(max(running))]
                killed.append(victim)
                os.kill(core, signal.SIGKILL)
            finally:
                for _, core, _, _ in engines:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(core, signal.SIGCONT)
            return reference, [r for rs in await asyncio.gather(*tasks) for r in rs]

    reference, results = asyncio.run(run())
    assert all(r["done"] and not r["error"] and r["tokens"] == TOKENS for r in reference), reference
    for k, r in enumerate(results):
        i = k // ROUNDS
        assert r["done"] and not r["error"], (i, r)
        assert r["tokens"] == TOKENS and r["ids"] == 1, (i, r)
        assert r["roles"] == (1 if i % 2 else 0), (i, r)
        assert r["text"] == reference[i]["text"], (i, r["text"], reference[i]["text"])
    deadline = time.monotonic() + 60  # Ray's exporter reports with a delay of several seconds
    while _migrations(stack) <= before:
        assert time.monotonic() < deadline, "no migration was counted"
        time.sleep(2)
    # Serve replaces the replica whose engine died; later tests see two again
    deadline = time.monotonic() + 300
    while killed[0] in _replica_pids(APP):
        assert time.monotonic() < deadline, "the replica with the dead engine was not replaced"
        time.sleep(1)
    _wait_replicas(stack, APP, 2, 300)
