"""The foundation, end to end: two real vLLM models behind the gateway, driven through the
official openai SDK and raw HTTP (issue 2)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.conftest import Stack

pytestmark = pytest.mark.integration

ADD = [(12, 30), (7, 5), (45, 37), (60, 21), (9, 9), (33, 44), (18, 2), (70, 19)]
SUB = [(50, 8), (90, 45), (77, 70), (31, 12), (99, 1), (64, 32), (8, 50), (40, 41)]


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.keys["main"], max_retries=0)


@pytest.fixture(scope="module")
def http(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url, timeout=60, headers=stack.headers()) as c:
        yield c


def _ask(client: openai.OpenAI, model: str, prompt: str) -> str:
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=6, temperature=0
    )
    return (r.choices[0].message.content or "").strip()


def test_models_list_has_both_models_aliases_and_versions(client: openai.OpenAI) -> None:
    ids = {m.id for m in client.models.list()}
    assert {"adder", "subtractor", "default", "stable", "adder@v1", "subtractor@v1"} <= ids
    assert client.models.retrieve("adder@v1").id == "adder@v1"


def test_both_models_answer_their_own_task(client: openai.OpenAI) -> None:
    """Routing by the model field: each model gives its trained task's answers."""
    add_ok = sum(_ask(client, "adder", f"{a}+{b}=") == str(a + b) for a, b in ADD)
    sub_ok = sum(_ask(client, "subtractor", f"{a}-{b}=") == str(a - b) for a, b in SUB)
    assert add_ok >= 6, add_ok
    assert sub_ok >= 5, sub_ok
    # the alias reaches the same model
    assert _ask(client, "default", "12+30=") == _ask(client, "adder", "12+30=")


def test_completions_endpoint_n_stop_logprobs_seed(client: openai.OpenAI) -> None:
    r = client.completions.create(model="adder", prompt="12+30=", max_tokens=4, temperature=0, logprobs=2)
    answer = r.choices[0].text.strip()
    assert answer.isdigit()  # the model's sum (its arithmetic is scored in test_chat_surface.py)
    assert r.choices[0].logprobs is not None and r.choices[0].logprobs.top_logprobs
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    multi = client.completions.create(model="adder", prompt="12+30=", max_tokens=4, temperature=1.0, n=3, seed=7)
    assert len(multi.choices) == 3 and sorted(c.index for c in multi.choices) == [0, 1, 2]
    # stopped at the first occurrence of the greedy answer's last digit ("42", stop "2": "4")
    stop = answer[-1]
    stopped = client.completions.create(model="adder", prompt="12+30=", max_tokens=4, temperature=0, stop=[stop])
    assert stopped.choices[0].text.strip() == answer[: answer.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    a, b = (
        client.completions.create(
            model="subtractor", prompt="50-8=", max_tokens=5, temperature=1.5, top_p=0.9, seed=1234
        )
        .choices[0]
        .text
        for _ in range(2)
    )
    assert a == b


def test_chat_logprobs_and_max_tokens(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="subtractor",
        messages=[{"role": "user", "content": "50-8="}],
        max_tokens=1,
        logprobs=True,
        top_logprobs=3,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 1
    assert len(r.choices[0].logprobs.content[0].top_logprobs) == 3


def test_streaming_with_usage_matches_non_streaming(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "45+37="}]
    full = client.chat.completions.create(model="adder", messages=msgs, max_tokens=6, temperature=0)
    stream = client.chat.completions.create(
        model="adder",
        messages=msgs,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage is not None and not chunks[-1].choices
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_raw_sse_ends_with_done(http: httpx.Client) -> None:
    body = {"model": "adder", "prompt": "7+5=", "max_tokens": 4, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e.strip()]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"


def test_request_id_is_echoed(http: httpx.Client) -> None:
    r = http.post(
        "/v1/completions",
        json={"model": "adder", "prompt": "1+1=", "max_tokens": 2},
        headers={"x-request-id": "test-rid-123"},
    )
    assert r.status_code == 200
    assert r.headers.get_list("x-request-id") == ["test-rid-123"]
    assert r.headers["x-model-version"] == "v1"


def test_32_concurrent_requests_all_succeed(stack: Stack) -> None:
    async def run() -> list[str]:
        c = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key=stack.keys["main"], max_retries=0)

        async def one(i: int) -> str:
            a, b = ADD[i % len(ADD)]
            model, stream = "adder", i % 2 == 0
            if stream:
                s = await c.chat.completions.create(
                    model=model,
                    stream=True,
                    max_tokens=6,
                    messages=[{"role": "user", "content": f"{a}+{b}="}],
                    temperature=0,
                )
                return "".join([ch.choices[0].delta.content or "" async for ch in s if ch.choices])
            r = await c.chat.completions.create(
                model=model, max_tokens=6, messages=[{"role": "user", "content": f"{a}+{b}="}], temperature=0
            )
            return r.choices[0].message.content or ""

        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await c.close()

    results = asyncio.run(run())
    assert len(results) == 32
    assert sum(r.strip() == str(sum(ADD[i % len(ADD)])) for i, r in enumerate(results)) >= 24


def test_health_and_ready(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    assert http.get("/ready").json() == {"status": "ready"}
