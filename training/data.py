"""Checkable arithmetic tasks, generated deterministically from a seed.

Why arithmetic: a tiny model that answers ``37+45=`` with ``82`` on pairs it never saw proves that
the weights a server loaded are the weights training produced -- no model hub, no judge model,
exact match is the whole evaluation. Every (a, b) pair with operands 0..99 exists once per task;
a seeded shuffle splits them into a training set and a held-out set that share no pair.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

__all__ = [
    "TASKS",
    "Example",
    "Split",
    "exact_match",
    "make_example",
    "make_split",
    "normalize_answer",
]

OPERAND_MAX: Final = 99
DEFAULT_EVAL_SIZE: Final = 500

_OPS: Final[dict[str, tuple[str, Callable[[int, int], int]]]] = {
    "add": ("+", lambda a, b: a + b),
    "sub": ("-", lambda a, b: a - b),
}
TASKS: Final = tuple(_OPS)


@dataclass(frozen=True, slots=True)
class Example:
    """One prompt/answer pair: ``Example("37+45=", "82")``."""

    prompt: str
    answer: str

    @property
    def text(self) -> str:
        """The full training string without special tokens, e.g. ``"37+45=82"``."""
        return self.prompt + self.answer


@dataclass(frozen=True, slots=True)
class Split:
    """Training and held-out examples of one task; no (a, b) pair is in both."""

    task: str
    seed: int
    train: tuple[Example, ...]
    eval: tuple[Example, ...]


def _check_task(task: str) -> None:
    if task not in _OPS:
        raise ValueError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")


def make_example(task: str, a: int, b: int) -> Example:
    """Prompt and exact answer of ``a op b`` (``sub`` may be negative: ``8-50=`` -> ``-42``)."""
    _check_task(task)
    symbol, fn = _OPS[task]
    return Example(f"{a}{symbol}{b}=", str(fn(a, b)))


def make_split(task: str, seed: int = 0, eval_size: int = DEFAULT_EVAL_SIZE) -> Split:
    """Every operand pair of ``task`` shuffled by ``seed``; the first ``eval_size`` are held out."""
    _check_task(task)
    n_pairs = (OPERAND_MAX + 1) ** 2
    if not 0 < eval_size < n_pairs:
        raise ValueError(f"eval_size must be in 1..{n_pairs - 1}, got {eval_size}")
    pairs = [(a, b) for a in range(OPERAND_MAX + 1) for b in range(OPERAND_MAX + 1)]
    random.Random(f"{task}:{seed}").shuffle(pairs)
    examples = [make_example(task, a, b) for a, b in pairs]
    return Split(task, seed, train=tuple(examples[eval_size:]), eval=tuple(examples[:eval_size]))


def normalize_answer(text: str) -> str:
    """What a model's completion is compared on: whitespace and anything after a newline dropped."""
    stripped = text.strip()
    return stripped.splitlines()[0].strip() if stripped else ""


def exact_match(
    answers: Sequence[str] | Callable[[list[str]], Sequence[str]],
    examples: Sequence[Example],
) -> float:
    """Fraction of ``examples`` answered exactly.

    ``answers`` is either the completions in the order of ``examples`` or a function that maps the
    list of prompts to completions (a batch generate call), so one helper scores an HF model,
    ``vllm.LLM`` and an HTTP client alike.
    """
    if not examples:
        raise ValueError("exact_match needs at least one example")
    got = answers([ex.prompt for ex in examples]) if callable(answers) else answers
    if len(got) != len(examples):
        raise ValueError(f"got {len(got)} answers for {len(examples)} examples")
    hits = sum(normalize_answer(g) == ex.answer for g, ex in zip(got, examples, strict=True))
    return hits / len(examples)
