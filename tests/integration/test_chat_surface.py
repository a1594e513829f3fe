"""What the default models decide, measured through the gateway with the official openai SDK on
held-out prompts (:func:`training.datasets.probes`): tool calls with ``tool_choice: auto``, the
follow-up with a tool's result, JSON mode, system prompts and history.

Grammar-forced output proves nothing by itself (vLLM forces JSON and a forced tool choice with a
grammar, so an untrained model passes those): every check here scores the *values* the model chose
and whether it chose to call a tool at all. Both default models run the checks, so two families
and two chat templates go through the same code.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tests.conftest import Stack
from training.datasets import Probe, probes

pytestmark = pytest.mark.integration

MODELS = {"adder": "add", "subtractor": "sub"}
N = 30  # held-out probes per kind and model


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.keys["main"], max_retries=0)


def _reply(client: openai.OpenAI, model: str, probe: Probe, **extra: Any) -> tuple[str | None, list[tuple[str, str]]]:
    assert probe.messages is not None
    kwargs: dict[str, Any] = {"model": model, "messages": probe.messages, "max_tokens": 48, "temperature": 0}
    if probe.tools:
        kwargs |= {"tools": probe.tools, "tool_choice": "auto"}
    r = client.chat.completions.create(**kwargs, **extra)
    message = r.choices[0].message
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or [] if c.type == "function"]
    return message.content, calls


def _score(client: openai.OpenAI, model: str, kind: str, **extra: Any) -> float:
    cases = probes(MODELS[model], kind, N, seed=0)
    hits = sum(p.check(*_reply(client, model, p, **extra)) for p in cases)
    return hits / len(cases)


# What each kind must score through the API, for both models: the bar, 0.9, for the tool and
# JSON kinds, 0.8 for the effect of a system prompt and of history. Measured through the gateway on
# 2026-12-04 (docs/training.md, "What they learn"): adder 1.00 on every kind, subtractor 0.97-1.00.
# Training is deterministic for a seed, code and CPU, not across CPUs: a VM with another CPU once
# trained a worse model from the same recipe (docs/training.md), and such a model fails here.
FLOORS = {"tool_call": 0.9, "tool_unneeded": 0.9, "tool_result": 0.9, "json": 0.9, "system": 0.8, "multi_turn": 0.8}


@pytest.mark.parametrize("kind", FLOORS)
@pytest.mark.parametrize("model", MODELS)
def test_what_the_model_decides_on_held_out_prompts(client: openai.OpenAI, model: str, kind: str) -> None:
    """tool_call: right function and argument values with tool_choice auto; tool_unneeded: no call
    and the right answer; tool_result: the follow-up carrying the tool's result is answered with
    it; json: right values under response_format json_object; system / multi_turn: the answer
    changes the way the data teaches."""
    extra: dict[str, Any] = {"response_format": {"type": "json_object"}} if kind == "json" else {}
    score = _score(client, model, kind, **extra)
    print(f"{model} {kind}: {score:.2f} on {N} held-out probes")
    assert score >= FLOORS[kind], score


def test_a_whole_tool_round_trip_through_the_sdk(client: openai.OpenAI) -> None:
    """The client's own loop on held-out questions: ask, run the tool the model called, send its
    result back (the SDK's assistant message with tool_calls, then a tool message), read the answer."""
    right_calls = right_answers = 0
    cases = probes("sub", "tool_call", 10, seed=1)
    for probe in cases:
        messages: list[Any] = list(probe.messages or [])
        tools: Any = probe.tools
        first = client.chat.completions.create(
            model="subtractor", messages=messages, tools=tools, temperature=0, max_tokens=48
        )
        call = (first.choices[0].message.tool_calls or [None])[0]
        if call is None or call.type != "function" or first.choices[0].finish_reason != "tool_calls":
            continue
        args = json.loads(call.function.arguments)
        right_calls += (call.function.name, args) == probe.call
        messages += [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"result": args["a"] - args["b"]})},
        ]
        second = client.chat.completions.create(
            model="subtractor", messages=messages, tools=tools, temperature=0, max_tokens=16
        )
        answer = (second.choices[0].message.content or "").strip()
        right_answers += answer == str(args["a"] - args["b"]) and not second.choices[0].message.tool_calls
    print(f"round trips: {right_calls}/{len(cases)} right calls, {right_answers}/{len(cases)} right answers")
    assert right_calls >= 9 and right_answers >= 8


def test_non_ascii_text_round_trips(client: openai.OpenAI) -> None:
    """Byte-level BPE: any UTF-8 reaches the model and comes back as the same characters."""
    text = "Grüße aus 東京 🙂 ="
    r = client.completions.create(model="adder", prompt=text, echo=True, max_tokens=1, temperature=0)
    assert r.choices[0].text.startswith(text)
