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


@pytest.mark.parametrize("model", MODELS)
def test_tool_choice_auto_calls_the_right_function_with_the_right_arguments(client: openai.OpenAI, model: str) -> None:
    assert _score(client, model, "tool_call") >= 0.9


@pytest.mark.parametrize("model", MODELS)
def test_tool_choice_auto_calls_nothing_where_no_tool_is_needed(client: openai.OpenAI, model: str) -> None:
    assert _score(client, model, "tool_unneeded") >= 0.9


@pytest.mark.parametrize("model", MODELS)
def test_the_tool_result_becomes_the_answer(client: openai.OpenAI, model: str) -> None:
    """A follow-up carrying the tool's result (the SDK's assistant tool_calls + tool message)."""
    assert _score(client, model, "tool_result") >= 0.9


@pytest.mark.parametrize("model", MODELS)
def test_json_mode_values_are_right(client: openai.OpenAI, model: str) -> None:
    assert _score(client, model, "json", response_format={"type": "json_object"}) >= 0.9


@pytest.mark.parametrize("model", MODELS)
def test_a_system_prompt_and_a_history_change_the_answer_as_the_data_teaches(client: openai.OpenAI, model: str) -> None:
    assert _score(client, model, "system") >= 0.8
    assert _score(client, model, "multi_turn") >= 0.8


def test_a_whole_tool_round_trip_through_the_sdk(client: openai.OpenAI) -> None:
    """The client's own loop: ask, run the tool the model called, send its result, read the answer."""
    tools: Any = [probes("add", "tool_call", 1)[0].tools or []][0]
    messages: list[Any] = [{"role": "user", "content": "What is 4821+377?"}]
    first = client.chat.completions.create(model="adder", messages=messages, tools=tools, temperature=0, max_tokens=48)
    call = (first.choices[0].message.tool_calls or [None])[0]
    assert call is not None and call.type == "function" and first.choices[0].finish_reason == "tool_calls"
    args = json.loads(call.function.arguments)
    assert (call.function.name, args) == ("add", {"a": 4821, "b": 377})
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])},
    ]
    second = client.chat.completions.create(model="adder", messages=messages, tools=tools, temperature=0, max_tokens=16)
    assert (second.choices[0].message.content or "").strip() == "5198"
    assert not second.choices[0].message.tool_calls


def test_non_ascii_text_round_trips(client: openai.OpenAI) -> None:
    """Byte-level BPE: any UTF-8 reaches the model and comes back as the same characters."""
    text = "Grüße aus 東京 🙂 ="
    r = client.completions.create(model="adder", prompt=text, echo=True, max_tokens=1, temperature=0)
    assert r.choices[0].text.startswith(text)
