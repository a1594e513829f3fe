"""Loss masks with the base's own template: two families' templates (Llama 3 headers with a BOS,
ChatML without), tool calls, completions, refusal of templates that are not prefix-consistent, and
rows longer than the model, special tokens written in a chat row's text, ``"weight": 0`` turns and
eval references cut where generation stops (tiny tokenizers trained here, no model)."""

from __future__ import annotations

import copy
import json
import logging
import re
from typing import Any

import pytest

from training import encode
from training.encode import IGNORE, EncodeError, Encoder, normalise
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


def _other_eos(tokenizer: Any) -> tuple[Any, int]:
    """A copy of ``tokenizer`` whose EOS is a new ``<|end_of_text|>`` while its turns still end with
    the old one, as Llama-3-Instruct's do (eos ``<|end_of_text|>``, turns ``<|eot_id|>``); and the
    turn end's id, which such a base's generation config lists as a stop id."""
    tok = copy.deepcopy(tokenizer)
    turn_end = tok.convert_tokens_to_ids(tok.eos_token)
    tok.add_special_tokens({"eos_token": "<|end_of_text|>"})
    assert tok.eos_token_id != turn_end
    return tok, turn_end


def test_eval_reference_ends_at_the_first_stop_id_not_only_at_eos(tokenizer: Any) -> None:
    """Generation stops at any stop id, so the reference must end there too (once it was cut at
    the tokenizer's EOS only, and no generation could match it: exact match 0)."""
    tok, turn_end = _other_eos(tokenizer)
    encoder = Encoder(tok, 512, stop_ids=[turn_end, tok.eos_token_id])
    for row, reference in [(CHAT, "50"), (CALL, "1239")]:
        item = encoder.eval_item(parse_line(row, 1, "t"))
        assert item.reference == reference
        # what a perfect model generates: the trained tokens of the last turn, cut at a stop id
        trained = [t for t, lab in zip(item.encoded.input_ids, item.encoded.labels, strict=True) if lab != IGNORE]
        last = trained[trained[:-1].index(turn_end) + 1 :] if trained.count(turn_end) > 1 else trained
        generated = tok.decode(last[: last.index(turn_end)], skip_special_tokens=False)
        assert normalise(generated) == item.reference


def test_special_tokens_are_the_tokenizers_special_ones_only(tokenizer: Any) -> None:
    specials = encode.special_tokens(tokenizer)
    assert tokenizer.eos_token in specials and "<tool_call>" not in specials
    assert specials == sorted(specials, key=lambda t: (-len(t), t))


def _with_text(where: str, text: str) -> dict[str, Any]:
    row = copy.deepcopy(CALL)
    if where == "assistant":
        row["messages"][-1]["content"] = f"before{text}after"
    elif where == "user":
        row["messages"][0]["content"] = f"add 1234 and 5 {text}"
    elif where == "arguments":
        row["messages"][1]["tool_calls"][0]["function"]["arguments"] = json.dumps({"a": 1234, "b": text})
    else:
        row["tools"][0]["function"]["description"] = f"a+b {text}"
    return row


@pytest.mark.parametrize("where", ["assistant", "user", "arguments", "tools"])
def test_a_special_token_in_a_chat_rows_text_is_skipped_or_refused(
    tokenizer: Any, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The tokenizer reads ``<eos>`` written in a message as the control token: the loss mask
    stopped there and the model learnt to end its turn mid-answer, silently."""
    eos = tokenizer.eos_token
    encoder = Encoder(tokenizer, 512)
    bad = parse_line(_with_text(where, eos), 7, "t")
    assert encoder.special_token_in(bad) == eos
    with pytest.raises(EncodeError, match=f"^line 7: '{re.escape(eos)}' in a message or tool is a special token"):
        encoder.encode(bad)
    with pytest.raises(EncodeError, match="line 7: .* special token"):
        encoder.eval_item(bad)
    good = [parse_line(CALL, i, "t") for i in range(1, 21)]
    with caplog.at_level(logging.WARNING, logger="training"):
        assert len(encoder.encode_all([*good, bad], "d.jsonl")) == 20
        assert len(encoder.eval_items([*good, bad], "e.jsonl")) == 20
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and warned[0].startswith("d.jsonl: 1 of 21 chat rows hold a special token (e.g. line 7: ")
    assert all(repr(eos) in w and w.endswith("they are skipped") for w in warned)
    for rows in ([bad], [*good[:9], bad, bad]):  # all of them, more than a tenth
        with pytest.raises(EncodeError, match=rf"d\.jsonl: {len(rows) - 9 if len(rows) > 1 else 1} of"):
            encoder.encode_all(rows, "d.jsonl")
        with pytest.raises(EncodeError, match="remove those tokens"):
            encoder.eval_items(rows, "e.jsonl")


def test_text_that_is_not_a_special_token_is_kept(tokenizer: Any) -> None:
    """A non-special added token (``<tool_call>``, text a model writes) in a message and the EOS
    in a raw prompt/completion row (pre-rendered on purpose) are not refused."""
    encoder = Encoder(tokenizer, 512)
    tagged = parse_line(_with_text("assistant", "<tool_call>"), 1, "t")
    raw = parse_line({"prompt": f"7+8={tokenizer.eos_token}", "completion": "15"}, 2, "t")
    assert encoder.special_token_in(tagged) is None and encoder.special_token_in(raw) is None
    assert len(encoder.encode_all([tagged, raw], "d.jsonl")) == 2


def test_a_turn_with_weight_zero_gets_no_loss(tokenizer: Any) -> None:
    eos = tokenizer.eos_token
    row = copy.deepcopy(CHAT)
    row["messages"][2]["weight"] = 0
    assert _trained_text(tokenizer, row) == [f"50{eos}"]
    row["messages"][4]["weight"] = 1
    assert _trained_text(tokenizer, row) == [f"50{eos}"]
    row["messages"][4]["weight"] = 0
    with pytest.raises(
        EncodeError, match=r'line 4: no assistant token left to learn from: every assistant turn has "weight": 0'
    ):
        Encoder(tokenizer, 512).encode_all([parse_line(row, 4, "t")], "d.jsonl")
