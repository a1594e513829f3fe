"""The gateway's chat tokens for ``router: kv_aware`` (serving/gateway/kv_chat.py) against vLLM
0.32's own chat renderer, what its ``/v1/chat/completions`` runs: the request model, its chat
params, ``parse_chat_messages`` and ``safe_apply_chat_template``, with the same tokenizer. A token
that differs loses every block after it to the index."""

from __future__ import annotations

import copy
import types
from functools import cache
from typing import Any

import pytest

from serving.contract import block_keys
from serving.gateway.kv_chat import content_format
from serving.gateway.kv_index import KVFeeds, Prompts

SYSTEM = "You are a careful assistant for the billing team. " * 6
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
]
CALL = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a":2,"b":3}'}}
STRING_TEMPLATE = (  # a template that never loops over content, nor names the developer role
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DEVELOPER_TEMPLATE = (  # one that names the developer role: vLLM leaves those turns as they are
    "{% for m in messages %}<|im_start|>{{ 'dev' if m['role'] == 'developer' else m['role'] }}\n"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CASES: dict[str, dict[str, Any]] = {
    "system and user": {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]},
    "developer": {"messages": [{"role": "developer", "content": SYSTEM}, {"role": "user", "content": "hi"}]},
    "developer after system": {
        "messages": [
            {"role": "system", "content": "a"},
            {"role": "user", "content": "hi"},
            {"role": "developer", "content": "b"},
        ]
    },
    "tool call, compact JSON arguments": {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "add 2 and 3"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": "5"},
            {"role": "user", "content": "and 4?"},
        ],
        "tools": TOOLS,
    },
    "tool call arguments not an object, or empty": {
        "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "add", "arguments": "[1]"}}]},
            {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "add", "arguments": ""}}]},
        ]
    },
    "text parts": {"messages": [{"role": "user", "content": [{"type": "text", "text": "one"}, "two"]}]},
    "tool result parts": {
        "messages": [
            {"role": "user", "content": "q"},
            {
                "role": "tool",
                "tool_call_id": "c",
                "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}],
            },
        ]
    },
    "continue_final_message": {
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
    "chat_template_kwargs under the request's fields": {
        "messages": [{"role": "user", "content": "q"}],
        "chat_template_kwargs": {"add_generation_prompt": False, "enable_thinking": True},
        "add_generation_prompt": True,
    },
    "chat_template_kwargs alone": {
        "messages": [{"role": "user", "content": "q"}],
        "chat_template_kwargs": {"add_generation_prompt": False},
    },
    "a tool without description or parameters": {
        "messages": [{"role": "user", "content": "q"}],
        "tools": [{"type": "function", "function": {"name": "f"}}],
    },
    "Claude Code's billing header": {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "x-anthropic-billing-header: cch=1\nthe system"}]},
            {"role": "user", "content": "q"},
        ]
    },
    "reasoning": {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "reasoning": "hmm"},
            {"role": "user", "content": "q2"},
        ],
        "reasoning_effort": "low",
    },
}


@cache
def _tokenizer(family: str) -> Any:
    from training.families import build_tokenizer

    corpus = [f"{SYSTEM} add 2 and 3 tool call arguments {i} + {i} = {2 * i}" for i in range(30)]
    return build_tokenizer(family, corpus, vocab_size=400)


def _engine_tokens(tok: Any, body: dict[str, Any]) -> list[int]:
    """What vLLM's chat completions serving renders and tokenizes for ``body``."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.renderers import hf
    from vllm.renderers.chat_utils import parse_chat_messages
    from vllm.renderers.hf import resolve_chat_template_content_format, safe_apply_chat_template

    hf._CONTENT_FORMATS.clear()  # cached by the tokenizer's path, the same for these variants

    config = types.SimpleNamespace(
        multimodal_config=None,
        tokenizer_revision=None,
        code_revision=None,
        revision=None,
        tokenizer="t",
        model="t",
        trust_remote_code=False,
        hf_config=None,
        enable_prompt_embeds=False,
    )
    request = ChatCompletionRequest.model_validate({"model": "m", **copy.deepcopy(body)})
    tools = None if request.tools is None else [t.model_dump() for t in request.tools]
    params = request.build_chat_params(None, "auto").with_defaults({"tools": tools, "tokenize": False})
    kwargs = params.get_apply_chat_template_kwargs()
    fmt = resolve_chat_template_content_format(None, kwargs.get("tools"), "auto", tok, model_config=config)
    conversation, _, _ = parse_chat_messages(request.messages, config, fmt)
    text = safe_apply_chat_template(config, tok, conversation, **kwargs)
    return list(tok(text, add_special_tokens=request.add_special_tokens)["input_ids"])


@pytest.mark.parametrize("template", ["family", "string", "developer"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_gateways_chat_tokens_are_vllms(case: str, family: str, template: str) -> None:
    tok = copy.copy(_tokenizer(family))
    if template != "family":
        tok.chat_template = STRING_TEMPLATE if template == "string" else DEVELOPER_TEMPLATE
    body = CASES[case]
    sent = copy.deepcopy(body)
    ours = Prompts(tok).tokens("chat", body)
    assert body == sent  # the body is forwarded afterwards: never changed
    assert ours == _engine_tokens(tok, body)


def test_the_developer_role_and_json_arguments_no_longer_cost_the_prefix() -> None:
    """The reviewer's case: a developer system prompt matched no block at all, and compact
    tool-call arguments lost the blocks after the first call."""
    tok = _tokenizer("qwen3")
    feeds = KVFeeds()
    feeds.index.block_size["m--v1"] = 4
    feeds._prompts["m--v1"] = Prompts(tok)
    for body in (CASES["developer"], CASES["tool call, compact JSON arguments"]):
        keys = feeds.keys("m--v1", "chat", body, None)
        assert keys is not None and list(keys) == block_keys(_engine_tokens(tok, body), 4)


def test_requests_the_engine_renders_otherwise_get_no_keys() -> None:
    prompts = Prompts(_tokenizer("qwen2"))
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    assert prompts.tokens("chat", {"messages": [{"role": "user", "content": [image]}]}) is None
    assert prompts.tokens("chat", {"messages": [{"role": "user", "content": "q"}], "chat_template": "{{ 1 }}"}) is None


@pytest.mark.parametrize(
    "template",
    [
        STRING_TEMPLATE,
        "{% for m in messages %}{% for c in m['content'] %}{{ c.text }}{% endfor %}{% endfor %}",
        "{% set ms = messages[1:] %}{% for m in ms %}{% for c in m.content | list %}{{ c }}{% endfor %}{% endfor %}",
        "{% macro t(x) %}{% for p in x %}{{ p.text }}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ t(m.content) }}{% endfor %}",
        "{% macro t(x) %}{% for p in x %}{{ p }}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ t(m.role) }}{% endfor %}",
        "{% for content in contents %}{{ content }}{% endfor %}{% for c in content %}{{ c }}{% endfor %}",
        "{% for k, v in messages %}{{ k }}{% endfor %}",
        "{% for m in messages %}{{ m.content }}",  # not a template: string
    ],
)
def test_the_content_format_is_the_one_vllm_detects(template: str) -> None:
    from vllm.renderers.hf import _detect_content_format

    assert content_format(template) == _detect_content_format(template, default="string")
    for family in ("llama", "qwen2", "qwen3"):
        family_template = _tokenizer(family).get_chat_template()
        assert content_format(family_template) == _detect_content_format(family_template, default="string")
