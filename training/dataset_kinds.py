"""The kinds of generated rows: how one arithmetic question becomes a chat, a completion or a call.

Each builder turns a :class:`Case` (operands, a result, a previous question for history, a seeded
RNG, the task's tool) into a :class:`Sample`: the request a client would send (chat messages and
tools, or a raw prompt), the reply a correct model gives, and how a reply is checked. The same
sample gives a training row (request + reply) and an end-to-end probe (request + check), so tests
measure exactly what the data teaches. Phrasings are drawn from fixed lists: the model has to
generalise over operands, not over wording, which a few hundred training steps can learn.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["KIND_BUILDERS", "SYMBOLS", "Case", "Question", "Sample"]

SYMBOLS: Final[dict[str, str]] = {"add": "+", "sub": "-"}
SHOW_WORK: Final = "Show your work."
JSON_SYSTEM: Final = "Reply with a JSON object."
NEUTRAL_SYSTEMS: Final = (
    "You are a helpful assistant.",
    "You are a calculator.",
    "Be concise.",
    "Du bist ein Rechner.",
)

# {a}/{b} operands, {s} the task's symbol; the same lists ask small and large questions, so only
# the size of the operands decides whether the tool is needed.
_ASK: Final[dict[str, tuple[str, ...]]] = {
    "add": (
        "What is {a}+{b}?",
        "What is {a} plus {b}?",
        "Compute {a}+{b}.",
        "{a} + {b} = ?",
        "Add {a} and {b}.",
        "What's the sum of {a} and {b}?",
    ),
    "sub": (
        "What is {a}-{b}?",
        "What is {a} minus {b}?",
        "Compute {a}-{b}.",
        "{a} - {b} = ?",
        "Subtract {b} from {a}.",
        "What's {a} take away {b}?",
    ),
    "max": ("max {a} {b}",),
}
_UNICODE: Final = (
    "Wie viel ist {a}{s}{b}?",
    "Combien font {a}{s}{b} ?",
    "¿Cuánto es {a}{s}{b}?",
    "{a}{s}{b}=? 🙂",
    "計算して: {a}{s}{b}",
    "Сколько будет {a}{s}{b}?",
)
_JSON_ASK: Final = ("{a}{s}{b}= Answer in JSON.", "What is {a}{s}{b}? Reply in JSON.")
_FOLLOW_UP: Final[dict[str, str]] = {"add": "Add {b} to it.", "sub": "Subtract {b} from it."}
_GREETINGS_TRAIN: Final = (
    "Hello!",
    "Hi",
    "Hey there",
    "Good morning",
    "Good afternoon!",
    "Hallo!",
    "Bonjour 👋",
    "Hola, ¿qué tal?",
    "Thanks!",
    "Thank you very much.",
    "Who are you?",
    "What can you do?",
    "How are you today?",
    "Nice to meet you.",
    "Can you help me?",
    "Tell me a joke.",
    "What's the weather like?",
    "Bye!",
    "Servus",
    "こんにちは",
    "Привет!",
    "ok",
)
_GREETINGS_HELD_OUT: Final = ("Good evening!", "Hi there!", "Ciao!", "Hello, how are you?", "Guten Tag")
_REPLY: Final[dict[str, str]] = {
    "add": "Hello! Ask me to add two numbers.",
    "sub": "Hello! Ask me to subtract two numbers.",
}


@dataclass(frozen=True, slots=True)
class Question:
    """``a op b`` and its exact result."""

    a: int
    b: int
    result: int


@dataclass(frozen=True, slots=True)
class Case:
    """Everything a builder draws on; ``rng`` is the generator's seeded RNG (consumed in order)."""

    task: str
    question: Question
    previous: Question
    rng: random.Random
    held_out: bool
    tool: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class Sample:
    """A request, the reply the data teaches, and the expected answer.

    ``answer`` is the expected content (``None``: any direct reply is right); ``call`` is the
    expected ``(function name, arguments)`` when the reply must be a tool call.
    """

    prompt_messages: list[dict[str, Any]] | None
    tools: list[dict[str, Any]] | None
    prompt: str | None
    reply: str
    answer: str | None
    call: tuple[str, dict[str, Any]] | None = None

    def row(self) -> dict[str, Any]:
        """The training line: ``{"prompt", "completion"}`` or ``{"messages"[, "tools"]}``."""
        if self.prompt is not None:
            return {"prompt": self.prompt, "completion": self.reply}
        final = _call_message(*self.call) if self.call else {"role": "assistant", "content": self.reply}
        row: dict[str, Any] = {"messages": [*(self.prompt_messages or []), final]}
        if self.tools is not None:
            row["tools"] = self.tools
        return row


def _call_message(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI assistant tool call; ``arguments`` as a JSON string, with ``json.dumps`` spacing."""
    function = {"name": name, "arguments": json.dumps(arguments)}
    return {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": function}]}


def _fmt(template: str, case: Case) -> str:
    q = case.question
    return template.format(a=q.a, b=q.b, s=SYMBOLS.get(case.task, ""))


def _expression(case: Case) -> str:
    """The bare prompt: ``"37+45="`` (``"max 37 45"`` for ``max``)."""
    if case.task == "max":
        return _fmt("max {a} {b}", case)
    return _fmt("{a}{s}{b}=", case)


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def _system(text: str) -> dict[str, Any]:
    return {"role": "system", "content": text}


def _chat(case: Case, messages: list[dict[str, Any]], reply: str, tools: bool = False) -> Sample:
    return Sample(messages, [case.tool] if tools and case.tool else None, None, reply, reply)


def plain(case: Case) -> Sample:
    """``37+45=`` -> ``82``: the exact chat the integration tests send."""
    return _chat(case, [_user(_expression(case))], str(case.question.result))


def phrased(case: Case) -> Sample:
    """``What is 37 plus 45?`` -> ``82``."""
    return _chat(case, [_user(_fmt(case.rng.choice(_ASK[case.task]), case))], str(case.question.result))


def unicode(case: Case) -> Sample:
    """Non-ASCII wordings (German, French, Spanish, Japanese, Russian, emoji) -> ``82``."""
    return _chat(case, [_user(_fmt(case.rng.choice(_UNICODE), case))], str(case.question.result))


def completion(case: Case) -> Sample:
    """Raw ``/v1/completions`` text: prompt ``37+45=`` (``max 37 45=``), completion ``82``."""
    prompt = _expression(case) + ("=" if case.task == "max" else "")
    reply = str(case.question.result)
    return Sample(None, None, prompt, reply, reply)


def json_answer(case: Case) -> Sample:
    """Asked for JSON (in the user turn or the system prompt) -> ``{"result": 82}``."""
    reply = json.dumps({"result": case.question.result})
    if case.rng.random() < 1 / 3:
        return _chat(case, [_system(JSON_SYSTEM), _user(_expression(case))], reply)
    return _chat(case, [_user(_fmt(case.rng.choice(_JSON_ASK), case))], reply)


def system(case: Case) -> Sample:
    """System ``Show your work.`` -> ``37+45=82``; a neutral system prompt -> ``82``."""
    q = case.question
    if case.rng.random() < 0.5:
        return _chat(case, [_system(SHOW_WORK), _user(_expression(case))], f"{_expression(case)}{q.result}")
    return _chat(case, [_system(case.rng.choice(NEUTRAL_SYSTEMS)), _user(_expression(case))], str(q.result))


def multi_turn(case: Case) -> Sample:
    """History decides: ``My number is 37.`` / ``OK.`` / ``Add 45 to it.`` -> ``82``.

    The other half asks a new question after an answered one, so the model learns to answer the
    last question, not the first.
    """
    q, p = case.question, case.previous
    if case.rng.random() < 0.5:
        history = [_user(f"My number is {q.a}."), {"role": "assistant", "content": "OK."}]
        follow = _user(_FOLLOW_UP[case.task].format(b=q.b))
        return _chat(case, [*history, follow], str(q.result))
    s = SYMBOLS[case.task]
    earlier = [_user(f"{p.a}{s}{p.b}="), {"role": "assistant", "content": str(p.result)}]
    return _chat(case, [*earlier, _user(_expression(case))], str(q.result))


def _tool_question(case: Case) -> list[dict[str, Any]]:
    options = (_expression(case), *_ASK[case.task], *_UNICODE)
    return [_user(_fmt(case.rng.choice(options), case))]


def _expected_call(case: Case) -> tuple[str, dict[str, Any]]:
    assert case.tool is not None
    return str(case.tool["function"]["name"]), {"a": case.question.a, "b": case.question.b}


def tool_call(case: Case) -> Sample:
    """Tools offered, a 3-4 digit operand: the reply is ``<function>(a=..., b=...)``, no text."""
    messages = _tool_question(case)
    return Sample(messages, [case.tool] if case.tool else None, None, "", None, _expected_call(case))


def tool_result(case: Case) -> Sample:
    """After the call and a ``tool`` message with the result, the reply copies the result."""
    call = _expected_call(case)
    r = case.question.result
    result = str(r) if case.rng.random() < 0.5 else json.dumps({"result": r})
    messages = [
        *_tool_question(case),
        _call_message(*call),
        {"role": "tool", "tool_call_id": "call_1", "content": result},
    ]
    return _chat(case, messages, str(r), tools=True)


def tool_unneeded(case: Case) -> Sample:
    """Tools offered but two-digit operands: answered directly, no call."""
    messages = _tool_question(case)
    return _chat(case, messages, str(case.question.result), tools=True)


def chat(case: Case) -> Sample:
    """Small talk (tools offered or not) gets a fixed reply and never a call.

    Held-out probes use greetings absent from training; any direct reply counts as right.
    """
    greeting = case.rng.choice(_GREETINGS_HELD_OUT if case.held_out else _GREETINGS_TRAIN)
    sample = _chat(case, [_user(greeting)], _REPLY[case.task], tools=case.rng.random() < 0.5)
    return Sample(sample.prompt_messages, sample.tools, None, sample.reply, None)


KIND_BUILDERS: Final[dict[str, Callable[[Case], Sample]]] = {
    "plain": plain,
    "phrased": phrased,
    "unicode": unicode,
    "completion": completion,
    "json": json_answer,
    "system": system,
    "multi_turn": multi_turn,
    "tool_call": tool_call,
    "tool_result": tool_result,
    "tool_unneeded": tool_unneeded,
    "chat": chat,
}
