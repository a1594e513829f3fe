"""Generated arithmetic datasets in the formats a user brings: OpenAI chat rows and prompt/completion.

Why arithmetic: exact answers make every behaviour checkable without a judge model, and a served
model that answers held-out sums proves the served weights are the trained ones. The content is
arithmetic, the *form* covers the chat surface: phrasings and non-ASCII text, raw completions,
JSON when asked, system prompts that change the answer, history that changes it, and tool calls.

Usage::

    python -m training.datasets add --out DIR      # DIR/train.jsonl, DIR/eval.jsonl

Row formats (one JSON object a line; ``kind`` is an extra key for grouping the evaluation)::

    {"messages": [{"role": "user", "content": "37+45="}, {"role": "assistant", "content": "82"}], "kind": "plain"}
    {"messages": [...], "tools": [TOOLS["add"]], "kind": "tool_call"}
    {"prompt": "37+45=", "completion": "82", "kind": "completion"}

The tool rule the data teaches: an operand of three or more digits needs the tool (beyond the
model's own skill); two-digit questions and small talk are answered directly even when tools are
offered. A tool result is copied into the answer.

Held-out rows never share an operand pair with training rows: two-digit pairs are split by the
seeded shuffle of every pair (500 held out), large pairs by a stable hash. The
generator is deterministic for a seed. :func:`probes` draws held-out requests with their expected
answers for end-to-end tests against a server.
"""

from __future__ import annotations

import argparse
import json
import random
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from training.dataset_kinds import KIND_BUILDERS, Case, Question

__all__ = [
    "KINDS",
    "TASKS",
    "TOOLS",
    "Probe",
    "base_corpus",
    "generate",
    "main",
    "probes",
    "write_dataset",
]

_OPS: Final[dict[str, Callable[[int, int], int]]] = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "max": max,
}
TASKS: Final = tuple(_OPS)


def _tool(name: str, description: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }


# The exact OpenAI tool schemas the data is rendered with; tests send these through the SDK.
TOOLS: Final[dict[str, dict[str, Any]]] = {
    "add": _tool("add", "Add two integers: a + b."),
    "sub": _tool("subtract", "Subtract two integers: a - b."),
}

# Training rows per kind (held-out rows: EVAL_ROWS each). ``max`` is the fine-tune task the
# default bases never see: plain chat and completions only. Training draws rows uniformly, so these
# are the kinds' shares of every batch: raw completions (the cheapest rows, ~9 tokens, and the
# format the promotion test asks in) get the most, since a model that learnt ``37+45=`` in a chat
# turn still missed it as raw text (completion 0.1 with 2000 rows). With 1000 tool_call and 1500
# tool_result rows those kinds fell to 0.77/0.72, hence the counts below.
KINDS: Final[dict[str, dict[str, int]]] = {
    "add": {
        "plain": 3000,
        "phrased": 2000,
        "unicode": 1500,
        "completion": 4000,
        "json": 1500,
        "system": 1500,
        "multi_turn": 1500,
        "tool_call": 1500,
        "tool_result": 2500,
        "tool_unneeded": 2000,
        "chat": 600,
    },
    "max": {"plain": 6000, "completion": 3000},
}
KINDS["sub"] = dict(KINDS["add"])
EVAL_ROWS: Final = 100
OPERAND_MAX: Final = 99
HELD_OUT_PAIRS: Final = 500  # two-digit pairs held out of the seeded shuffle
BIG_MIN: Final = 100
BIG_MAX: Final = 9999
_BIG_HELD_OUT_BUCKETS: Final = 10  # one bucket in ten of the large pairs is held out


def _check(task: str, kind: str | None = None) -> None:
    if task not in _OPS:
        raise ValueError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")
    if kind is not None and kind not in KINDS[task]:
        raise ValueError(f"task {task!r} has no kind {kind!r}; expected one of {', '.join(KINDS[task])}")


def _small_pairs(task: str, seed: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(train, held-out) two-digit pairs: every pair shuffled by ``task`` and ``seed``, the first
    ``HELD_OUT_PAIRS`` held out."""
    pairs = [(a, b) for a in range(OPERAND_MAX + 1) for b in range(OPERAND_MAX + 1)]
    random.Random(f"{task}:{seed}").shuffle(pairs)
    return pairs[HELD_OUT_PAIRS:], pairs[:HELD_OUT_PAIRS]


def _big_held_out(task: str, seed: int, a: int, b: int) -> bool:
    return zlib.crc32(f"{task}:{seed}:{a}:{b}".encode()) % _BIG_HELD_OUT_BUCKETS == 0


def _big_pair(task: str, seed: int, rng: random.Random, held_out: bool) -> tuple[int, int]:
    """A pair with at least one operand of 3-4 digits, from the requested side of the split."""
    while True:
        a = rng.randint(BIG_MIN, BIG_MAX)
        b = rng.randint(0, BIG_MAX)
        if rng.random() < 0.5:
            a, b = b, a
        if _big_held_out(task, seed, a, b) == held_out:
            return a, b


def _cases(task: str, kind: str, n: int, seed: int, held_out: bool, draw: str) -> list[Case]:
    """``n`` cases of one side of ``seed``'s split; ``draw`` names an independent RNG stream."""
    rng = random.Random(f"{task}:{kind}:{seed}:{draw}")
    train, evals = _small_pairs(task, seed)
    small = evals if held_out else train
    fn = _OPS[task]
    cases = []
    for _ in range(n):
        big = kind in ("tool_call", "tool_result")
        a, b = _big_pair(task, seed, rng, held_out) if big else rng.choice(small)
        history = rng.choice(train)
        cases.append(
            Case(
                task=task,
                question=Question(a, b, fn(a, b)),
                previous=Question(history[0], history[1], fn(*history)),
                rng=rng,
                held_out=held_out,
                tool=TOOLS.get(task),
            )
        )
    return cases


def generate(
    task: str, seed: int = 0, split: str = "train", rows: dict[str, int] | None = None
) -> list[dict[str, Any]]:
    """All rows of ``split`` ("train" or "eval") for ``task``, kinds interleaved by a seeded shuffle.

    ``rows`` overrides the number of rows per kind (default :data:`KINDS`, ``EVAL_ROWS`` each
    for eval).
    """
    _check(task)
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    held_out = split == "eval"
    counts = rows or {kind: (EVAL_ROWS if held_out else n) for kind, n in KINDS[task].items()}
    out: list[dict[str, Any]] = []
    for kind, n in counts.items():
        _check(task, kind)
        out.extend(
            KIND_BUILDERS[kind](case).row() | {"kind": kind} for case in _cases(task, kind, n, seed, held_out, split)
        )
    random.Random(f"{task}:{seed}:{split}:order").shuffle(out)
    return out


@dataclass(frozen=True, slots=True)
class Probe:
    """One held-out request and what a correct answer is.

    Chat probes have ``messages`` (and ``tools`` when offered); completion probes have ``prompt``.
    ``answer`` is the expected content (for ``json`` a JSON text compared after parsing);
    ``call`` is the expected ``(function name, arguments)`` when a tool must be called, else
    ``None`` and a correct reply makes no call.
    """

    kind: str
    messages: list[dict[str, Any]] | None
    tools: list[dict[str, Any]] | None
    prompt: str | None
    answer: str | None
    call: tuple[str, dict[str, Any]] | None

    def check(self, content: str | None, calls: Sequence[tuple[str, str]] = ()) -> bool:
        """Whether a reply (its content and its ``(name, arguments JSON)`` tool calls) is right."""
        if self.call is not None:
            if len(calls) != 1:
                return False
            name, arguments = calls[0]
            try:
                return name == self.call[0] and json.loads(arguments) == self.call[1]
            except ValueError:
                return False
        if calls:
            return False
        text = (content or "").strip()
        if self.answer is None:  # small talk: any direct reply
            return True
        if self.kind == "json":
            try:
                return bool(json.loads(text) == json.loads(self.answer))
            except ValueError:
                return False
        return text == self.answer


def probes(task: str, kind: str, n: int, seed: int = 0) -> list[Probe]:
    """``n`` held-out requests of ``kind`` (different draws than eval.jsonl for the same seed)."""
    _check(task, kind)
    out = []
    for case in _cases(task, kind, n, seed, held_out=True, draw="probe"):
        sample = KIND_BUILDERS[kind](case)
        out.append(
            Probe(
                kind=kind,
                messages=sample.prompt_messages,
                tools=sample.tools,
                prompt=sample.prompt,
                answer=sample.answer,
                call=sample.call,
            )
        )
    return out


def base_corpus(seed: int = 0) -> list[dict[str, Any]]:
    """Training rows of every task: the text a base's BPE merges are learnt from.

    Including the fine-tune task's rows in the *tokenizer* corpus (never in the base's training
    data) lets a fine-tune reuse the base's vocabulary with short sequences.
    """
    return [row for task in TASKS for row in generate(task, seed, "train")]


def write_dataset(task: str, out: str | Path, seed: int = 0, kinds: Sequence[str] | None = None) -> tuple[Path, Path]:
    """Write ``out/train.jsonl`` and ``out/eval.jsonl`` for ``task`` (only ``kinds`` when given);
    returns their paths."""
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for kind in kinds or ():
        _check(task, kind)
    for split in ("train", "eval"):
        path = directory / f"{split}.jsonl"
        n = {k: (EVAL_ROWS if split == "eval" else KINDS[task][k]) for k in kinds} if kinds else None
        lines = (json.dumps(row, ensure_ascii=False) for row in generate(task, seed, split, n))
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        paths.append(path)
    return paths[0], paths[1]


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m training.datasets TASK --out DIR [--seed N]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("task", choices=TASKS)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    train, evals = write_dataset(args.task, args.out, args.seed)
    print(f"wrote {train} and {evals}")


if __name__ == "__main__":
    main()
