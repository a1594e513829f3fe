"""Arithmetic pairs and their seeded split (the builtin datasets build on them), exact-match scoring."""

from __future__ import annotations

import re

import pytest

from training.data import TASKS, Example, exact_match, make_example, make_split, normalize_answer


@pytest.mark.parametrize(
    ("task", "a", "b", "prompt", "answer"),
    [
        ("add", 37, 45, "37+45=", "82"),
        ("add", 99, 99, "99+99=", "198"),
        ("add", 0, 0, "0+0=", "0"),
        ("sub", 50, 8, "50-8=", "42"),
        ("sub", 8, 50, "8-50=", "-42"),
        ("sub", 7, 7, "7-7=", "0"),
    ],
)
def test_example_format(task: str, a: int, b: int, prompt: str, answer: str) -> None:
    assert make_example(task, a, b) == Example(prompt, answer)


@pytest.mark.parametrize("task", TASKS)
def test_split_is_deterministic_disjoint_and_complete(task: str) -> None:
    split = make_split(task, seed=3)
    again = make_split(task, seed=3)
    assert split == again
    assert make_split(task, seed=4).eval != split.eval
    train, held = {e.prompt for e in split.train}, {e.prompt for e in split.eval}
    assert not train & held
    assert len(train) + len(held) == 100 * 100
    assert len(held) == 500
    symbol = "+" if task == "add" else "-"
    pattern = re.compile(rf"^(\d{{1,2}}){re.escape(symbol)}(\d{{1,2}})=$")
    for ex in split.eval:
        m = pattern.match(ex.prompt)
        assert m, ex.prompt
        a, b = int(m[1]), int(m[2])
        assert int(ex.answer) == (a + b if task == "add" else a - b)


def test_sub_has_negative_answers() -> None:
    answers = [e.answer for e in make_split("sub").train]
    assert any(a.startswith("-") for a in answers)
    assert all(re.fullmatch(r"-?\d{1,2}", a) for a in answers)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown task"):
        make_split("mul")
    with pytest.raises(ValueError, match="eval_size"):
        make_split("add", eval_size=0)


def test_exact_match_accepts_answers_or_a_function() -> None:
    examples = [Example("1+1=", "2"), Example("2+2=", "4"), Example("8-50=", "-42")]
    assert exact_match(["2", " 4\n", "-42"], examples) == 1.0
    assert exact_match(["2", "5", "42"], examples) == pytest.approx(1 / 3)
    table = {"1+1=": "2", "2+2=": "4", "8-50=": "-4"}
    score = exact_match(lambda prompts: [table[p] for p in prompts], examples)
    assert score == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="answers for"):
        exact_match(["2"], examples)
    with pytest.raises(ValueError):
        exact_match([], [])


def test_normalize_answer() -> None:
    assert normalize_answer("  82  ") == "82"
    assert normalize_answer("82\n37+1=38") == "82"
    assert normalize_answer("") == ""
