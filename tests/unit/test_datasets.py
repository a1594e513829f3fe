"""Generated datasets: formats, determinism, held-out split, the tool rule, probes (no model)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from training.datasets import KINDS, TASKS, TOOLS, Probe, base_corpus, generate, main, probes

SMALL = {"add": {kind: 40 for kind in KINDS["add"]}, "sub": {kind: 40 for kind in KINDS["sub"]}}


def _last_user(row: dict[str, Any]) -> str:
    return str(next(m["content"] for m in reversed(row["messages"]) if m["role"] == "user"))


def _operands(row: dict[str, Any]) -> tuple[int, ...]:
    text = row["prompt"] if "prompt" in row else " ".join(str(m.get("content")) for m in row["messages"][:1])
    if row["kind"] == "multi_turn" and _last_user(row).startswith(("Add", "Subtract")):
        text = f"{row['messages'][0]['content']} {_last_user(row)}"
    return tuple(int(n) for n in re.findall(r"\d+", text))


@pytest.mark.parametrize("task", ["add", "sub"])
def test_every_kind_and_the_exact_formats(task: str) -> None:
    rows = generate(task, rows=SMALL[task])
    assert {row["kind"] for row in rows} == set(KINDS[task])
    for row in rows:
        if row["kind"] == "completion":
            assert set(row) == {"prompt", "completion", "kind"}
            continue
        assert set(row) <= {"messages", "tools", "kind"}
        assert row["messages"][-1]["role"] == "assistant"
        if "tools" in row:
            assert row["tools"] == [TOOLS[task]]
    plain = next(row for row in rows if row["kind"] == "plain")
    a, b = _operands(plain)
    assert plain["messages"] == [
        {"role": "user", "content": f"{a}{'+' if task == 'add' else '-'}{b}="},
        {"role": "assistant", "content": str(a + b if task == "add" else a - b)},
    ]


def test_generation_is_deterministic_per_seed() -> None:
    assert generate("add", 0, rows=SMALL["add"]) == generate("add", 0, rows=SMALL["add"])
    assert generate("add", 0, rows=SMALL["add"]) != generate("add", 1, rows=SMALL["add"])


@pytest.mark.parametrize("task", TASKS)
def test_held_out_pairs_never_appear_in_training(task: str) -> None:
    kinds = ("plain", "completion", "tool_call") if task != "max" else ("plain", "completion")
    rows = {kind: 400 for kind in kinds}
    train = {(row["kind"] == "tool_call", _operands(row)) for row in generate(task, rows=rows)}
    held_out = {(row["kind"] == "tool_call", _operands(row)) for row in generate(task, split="eval", rows=rows)}
    assert train and held_out and not train & held_out


def test_the_tool_rule_the_data_teaches() -> None:
    rows = generate("sub", rows=SMALL["sub"])
    for row in rows:
        calls = [m for m in row["messages"] if m.get("tool_calls")] if "messages" in row else []
        if row["kind"] in ("tool_call", "tool_result"):
            (function,) = [call["function"] for call in calls[0]["tool_calls"]]
            args = json.loads(function["arguments"])
            assert function["name"] == "subtract" and set(args) == {"a", "b"}
            assert max(args.values()) >= 100 and sorted(_operands(row)) == sorted(args.values())
            if row["kind"] == "tool_result":
                assert (
                    row["messages"][-2]["role"] == "tool"
                    and str(args["a"] - args["b"]) in row["messages"][-2]["content"]
                )
                assert row["messages"][-1]["content"] == str(args["a"] - args["b"])
        else:
            assert not calls
        if row["kind"] == "tool_unneeded":
            assert max(_operands(row)) < 100 and row["tools"] == [TOOLS["sub"]]


def test_system_prompt_json_and_history_change_the_answer() -> None:
    rows = [row for row in generate("add", rows=SMALL["add"]) if "messages" in row]
    shown = [row for row in rows if row["messages"][0]["content"] == "Show your work."]
    assert shown
    for row in shown:
        question = row["messages"][1]["content"]
        assert row["messages"][-1]["content"].startswith(question)
    for row in (row for row in rows if row["kind"] == "json"):
        assert set(json.loads(row["messages"][-1]["content"])) == {"result"}
    history = [row for row in rows if row["kind"] == "multi_turn" and row["messages"][1]["content"] == "OK."]
    assert history
    for row in history:
        a, b = _operands(row)
        assert row["messages"][-1]["content"] == str(a + b)
    assert any(ord(ch) > 127 for row in rows if row["kind"] == "unicode" for ch in _last_user(row))


def test_probes_check_content_and_calls() -> None:
    (call,) = probes("add", "tool_call", 1)
    assert call.call is not None and call.tools == [TOOLS["add"]]
    name, args = call.call
    assert call.check(None, [(name, json.dumps(args))])
    assert not call.check(None, [(name, json.dumps(args | {"a": -1}))])
    assert not call.check(str(args["a"] + args["b"]))
    (plain,) = probes("add", "tool_unneeded", 1)
    assert (
        plain.answer is not None
        and plain.check(f" {plain.answer}\n")
        and not plain.check(plain.answer, [("add", "{}")])
    )
    (js,) = probes("sub", "json", 1)
    assert js.answer is not None and js.check(json.dumps(json.loads(js.answer), indent=2)) and not js.check("{}")
    (completion,) = probes("max", "completion", 1)
    assert completion.prompt is not None and completion.messages is None and completion.prompt.endswith("=")
    assert all(isinstance(p, Probe) for p in probes("add", "chat", 5)) and probes("add", "chat", 1)[0].check("hi")


def test_probes_are_held_out() -> None:
    train = {_operands(row) for row in generate("add", rows={"plain": 3000})}
    assert not any(_operands({"kind": "plain", "messages": p.messages}) in train for p in probes("add", "plain", 50))


def test_base_corpus_covers_every_task() -> None:
    corpus = base_corpus()
    assert {"add", "subtract"} <= {
        m["tool_calls"][0]["function"]["name"] for row in corpus for m in row.get("messages", []) if m.get("tool_calls")
    }
    assert any(str(row.get("prompt", "")).startswith("max ") for row in corpus)


def test_cli_writes_train_and_eval_jsonl(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["max", "--out", str(tmp_path / "max")])
    assert "train.jsonl" in capsys.readouterr().out
    train = (tmp_path / "max" / "train.jsonl").read_text(encoding="utf-8").splitlines()
    evals = (tmp_path / "max" / "eval.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(train) == sum(KINDS["max"].values()) and len(evals) == 100 * len(KINDS["max"])
    row = json.loads(train[0])
    assert row["kind"] in KINDS["max"]


def test_unknown_task_or_kind() -> None:
    with pytest.raises(ValueError, match="unknown task"):
        generate("mul")
    with pytest.raises(ValueError, match="no kind"):
        probes("max", "tool_call", 1)
