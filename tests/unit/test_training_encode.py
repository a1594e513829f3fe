"""Loss masks with the base's own template: two families' templates (Llama 3 headers with a BOS,
ChatML without), tool calls, completions, refusal of templates that are not prefix-consistent, and
rows longer than the model (tiny tokenizers trained here, no model)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from training.encode import IGNORE, EncodeError, Encoder
from training.families import build_tokenizer
from training.jsonl import parse_line

CHAT = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 12+30?"},
        {"role": "assistant", "content": "42"},
        {"role": "user", "content": "Add 8 to it."},
        {"role": "assistant", "content": "50"},
    ]
}
CALL = {
    "messages": [
        {"role": "user", "content": "add 1234 and 5"},
        {
            "role": "assistant",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": '{"a": 1234, "b": 5}'}}],
        },
        {"role": "tool", "content": "1239"},
        {"role": "assistant", "content": "1239"},
    ],
    "tools": [{"type": "function", "function": {"name": "add", "description": "a+b", "parameters": {}}}],
}
COMPLETION = {"prompt": "7+8=", "completion": "15"}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tokenizer(request: pytest.FixtureRequest) -> Any:
    return build_tokenizer(request.param, [CHAT, CALL, COMPLETION] * 20)


def _trained_text(tok: Any, row: dict[str, Any]) -> list[str]:
    enc = Encoder(tok, 512).encode(parse_line(row, 1, "t"))
    spans, current = [], []
    for tid, label in zip(enc.input_ids, enc.labels, strict=True):
        if label != IGNORE:
            assert label == tid
            current.append(tid)
        elif current:
            spans.append(tok.decode(current))
            current = []
    if current:
        spans.append(tok.decode(current))
    return spans


def test_loss_only_on_assistant_turns_up_to_end_of_turn(tokenizer: Any) -> None:
    eos = tokenizer.eos_token
    assert _trained_text(tokenizer, CHAT) == [f"42{eos}", f"50{eos}"]


def test_tool_call_turn_is_trained_as_the_template_renders_it(tokenizer: Any) -> None:
    eos = tokenizer.eos_token
    call, answer = _trained_text(tokenizer, CALL)
    assert call == f'<tool_call>{{"name": "add", "arguments": {{"a": 1234, "b": 5}}}}</tool_call>{eos}'
    assert answer == f"1239{eos}"


def test_chat_has_one_bos_and_completion_gets_the_tokenizers_specials(tokenizer: Any) -> None:
    encoder = Encoder(tokenizer, 512)
    chat = encoder.encode(parse_line(CHAT, 1, "t"))
    bos = tokenizer.bos_token_id
    if bos is not None:
        assert chat.input_ids[0] == bos and chat.input_ids.count(bos) == 1
    comp = encoder.encode(parse_line(COMPLETION, 1, "t"))
    assert tokenizer.decode([t for t, lab in zip(comp.input_ids, comp.labels, strict=True) if lab != IGNORE]) == (
        f"15{tokenizer.eos_token}"
    )
    assert comp.input_ids[: len(tokenizer("7+8=")["input_ids"])] == tokenizer("7+8=")["input_ids"]


def test_eval_item_prompt_and_reference(tokenizer: Any) -> None:
    encoder = Encoder(tokenizer, 512)
    item = encoder.eval_item(parse_line(CALL, 1, "t"))
    prompt = tokenizer.decode(item.prompt_ids)
    assert prompt.endswith(
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False)[
            -10:
        ]
    )
    assert "1239" in prompt and item.reference == "1239"
    first = encoder.eval_item(parse_line(CALL | {"messages": CALL["messages"][:2]}, 1, "t"))
    assert first.reference.startswith("<tool_call>") and first.reference.endswith("</tool_call>")
    comp = encoder.eval_item(parse_line(COMPLETION, 1, "t"))
    assert comp.reference == "15" and tokenizer.decode(comp.prompt_ids, skip_special_tokens=True) == "7+8="


def test_template_that_is_not_prefix_consistent_is_refused(tokenizer: Any) -> None:
    tok = copy.deepcopy(tokenizer)
    # The generation prompt says "Answer:" but a rendered assistant turn says "A:".
    tok.chat_template = (
        "{% for m in messages %}{% if m.role == 'assistant' %}A: {% else %}Q: {% endif %}{{ m.content }}\n"
        "{% endfor %}{% if add_generation_prompt %}Answer: {% endif %}"
    )
    with pytest.raises(EncodeError, match="not prefix-consistent"):
        Encoder(tok, 512).encode(parse_line(CHAT, 3, "t"))


def test_rows_longer_than_the_model_are_dropped_or_refused(tokenizer: Any) -> None:
    short = parse_line(COMPLETION, 1, "t")
    long = parse_line({"prompt": "1+" * 200, "completion": "2"}, 2, "t")
    encoder = Encoder(tokenizer, 64)
    assert len(encoder.encode_all([short] * 20 + [long], "d.jsonl")) == 20
    with pytest.raises(EncodeError, match=r"1 of 1 rows are longer than the model's 64 positions"):
        encoder.encode_all([long], "d.jsonl")


def test_errors_name_the_file_and_line(tokenizer: Any) -> None:
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = "{{ raise_exception('no system role') }}"
    encoder = Encoder(tok, 512)
    row = parse_line(CHAT, 3, "t")
    with pytest.raises(EncodeError, match=r"^train\.jsonl: line 3: the chat template failed: no system role"):
        encoder.encode_all([row], "train.jsonl")
    with pytest.raises(EncodeError, match=r"^eval\.jsonl: line 3: the chat template failed"):
        encoder.eval_items([row], "eval.jsonl")
