"""Families: init refs, chat templates, tokenizers and randomly initialised bases (no vLLM)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from training.datasets import KINDS, TOOLS, generate
from training.families import (
    FAMILIES,
    SIZES,
    InitRef,
    build_base,
    build_tokenizer,
    family_of,
    parse_init_ref,
    render,
)
from training.tokenizer import TOOL_TOKENS

ROWS = {kind: 20 for kind in KINDS["add"]}
CORPUS = generate("add", rows=ROWS) + generate("sub", rows=ROWS) + generate("max", rows={"plain": 20})


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def base(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    family = str(request.param)
    directory = build_base(tmp_path_factory.mktemp(family), f"init:{family}-tiny", CORPUS, seed=0)
    return family, directory


def test_parse_init_ref() -> None:
    assert parse_init_ref("init:llama-tiny") == InitRef("llama", "tiny")
    assert parse_init_ref("init:qwen2-small") == InitRef("qwen2", "small")
    for bad in ("llama-tiny", "init:llama", "init:gpt2-tiny", "init:qwen2-huge", "adder@v1"):
        with pytest.raises(ValueError):
            parse_init_ref(bad)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_row_renders_prefix_stable(family: str) -> None:
    """``render(messages[:i], add_generation_prompt=True)`` prefixes ``render(messages[:i+1])``."""
    for row in (r for r in CORPUS if "messages" in r):
        messages, tools = row["messages"], row.get("tools")
        full = render(family, messages, tools)
        for i, message in enumerate(messages):
            upto = render(family, messages[: i + 1], tools)
            assert full.startswith(upto)
            if message["role"] == "assistant":
                prefix = render(family, messages[:i], tools, add_generation_prompt=True)
                assert upto.startswith(prefix)
                assert FAMILIES[family].tokens.eos in upto[len(prefix) :]


def test_template_shapes() -> None:
    messages = [{"role": "system", "content": "Be concise."}, {"role": "user", "content": "37+45="}]
    assert render("llama", messages, add_generation_prompt=True) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe concise.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n37+45=<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert render("qwen2", messages, add_generation_prompt=True) == (
        "<|im_start|>system\nBe concise.<|im_end|>\n<|im_start|>user\n37+45=<|im_end|>\n<|im_start|>assistant\n"
    )
    with_tools = render("qwen2", messages[1:], [TOOLS["add"]])
    assert with_tools.startswith('<|im_start|>system\n<tools>{"name": "add", "description": ')


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tool_calls_render_alike_from_strings_objects_and_server_dumps(family: str) -> None:
    """OpenAI rows carry arguments as JSON text; vLLM parses them and dumps tools with extra nulls."""
    call = {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 4821, "b": 377}'}}
    parsed = {"id": "c", "type": "function", "function": {"name": "add", "arguments": {"a": 4821, "b": 377}}}
    user = {"role": "user", "content": "4821+377="}
    server_tool: dict[str, Any] = {
        "type": "function",
        "defer_loading": None,
        "function": TOOLS["add"]["function"] | {"strict": None, "defer_loading": None},
    }
    text = render(family, [user, {"role": "assistant", "tool_calls": [call]}], [TOOLS["add"]])
    served = render(family, [user, {"role": "assistant", "content": None, "tool_calls": [parsed]}], [server_tool])
    assert text == served
    assert '<tool_call>{"name": "add", "arguments": {"a": 4821, "b": 377}}</tool_call>' in text
    tool_reply = render(family, [user, {"role": "tool", "tool_call_id": "c", "content": "5198"}])
    assert "5198" in tool_reply


def test_content_parts_render_like_strings() -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "37+"}, {"type": "text", "text": "45="}]}]
    for family in FAMILIES:
        assert render(family, parts) == render(family, [{"role": "user", "content": "37+45="}])


def test_base_folder_loads_and_matches_the_trained_tokenizer(base: tuple[str, Path]) -> None:
    """transformers rebuilds a qwen2 tokenizer from vocab+merges: it must split text the same way."""
    family, directory = base
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in directory.iterdir()
    }
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == [FAMILIES[family].model_class.__name__]
    assert family_of(directory) is FAMILIES[family]
    loaded: Any = AutoTokenizer.from_pretrained(str(directory))
    trained = build_tokenizer(family, CORPUS)
    assert loaded.get_vocab() == trained.get_vocab()
    for row in CORPUS:
        if "messages" in row:
            text, special = render(family, row["messages"], row.get("tools")), False
        else:
            text, special = row["prompt"] + row["completion"], True
        assert loaded(text, add_special_tokens=special) == trained(text, add_special_tokens=special)
    generation = json.loads((directory / "generation_config.json").read_text())
    assert generation["eos_token_id"] == loaded.eos_token_id == config["eos_token_id"]
    assert loaded.convert_ids_to_tokens(loaded.eos_token_id) == FAMILIES[family].tokens.eos
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tokenizer_config["chat_template"] == FAMILIES[family].tokens.chat_template
    model = AutoModelForCausalLM.from_pretrained(str(directory))
    assert model.config.vocab_size == len(loaded)
    # random weights at the size's width-scaled spread, not transformers' default 0.02
    std = SIZES["tiny"].init_std
    assert config["initializer_range"] == std
    for weight in (model.model.layers[0].self_attn.q_proj.weight, model.model.layers[-1].mlp.down_proj.weight):
        assert abs(float(weight.std()) - std) < 0.05 * std
    with torch.no_grad():
        logits = model(torch.tensor([loaded("37+45=")["input_ids"]])).logits
    assert logits.shape[-1] == len(loaded)


def test_any_utf8_round_trips_and_tool_tags_survive(base: tuple[str, Path]) -> None:
    _, directory = base
    tok: Any = AutoTokenizer.from_pretrained(str(directory))
    for text in ("Grüße, 世界 🙂 ¿qué?", '{"result": -82}', "tab\tnew\nline  spaces"):
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    ids = [*tok(call, add_special_tokens=False)["input_ids"], tok.eos_token_id]
    assert tok.decode(ids, skip_special_tokens=True) == call
    for tag in TOOL_TOKENS:
        assert tag not in tok.all_special_tokens
        assert len(tok(tag, add_special_tokens=False)["input_ids"]) == 1
    for digit_string in ("4821", "37+45="):
        assert len(tok(digit_string, add_special_tokens=False)["input_ids"]) == len(digit_string)


def test_bos_once_for_chats_and_completions(base: tuple[str, Path]) -> None:
    """vLLM tokenizes a rendered chat without special tokens and a raw prompt with them."""
    family, directory = base
    tok: Any = AutoTokenizer.from_pretrained(str(directory))
    bos = FAMILIES[family].tokens.bos
    chat = tok(
        render(family, [{"role": "user", "content": "37+45="}], add_generation_prompt=True), add_special_tokens=False
    )
    completion = tok("37+45=")["input_ids"]
    if bos is None:
        assert tok.bos_token_id is None and chat["input_ids"][0] != completion[0]
    else:
        assert chat["input_ids"][0] == completion[0] == tok.convert_tokens_to_ids(bos)
        assert chat["input_ids"].count(completion[0]) == 1
    assert tok.decode(completion, skip_special_tokens=True) == "37+45="
