"""A chat request's prompt tokens as vLLM 0.32's ``/v1/chat/completions`` renders them, for
``router: kv_aware`` (:class:`serving.gateway.kv_index.Prompts`): the gateway keys a request's
blocks from these tokens, so a token that differs from the engine's loses every block after it.

vLLM's own renderer (``vllm.renderers.chat_utils.parse_chat_messages``,
``vllm.renderers.hf.safe_apply_chat_template``) is not imported into the gateway: importing it
loads torch-backed vLLM config, model-registry and attention modules (3.4 s and 107 MB more
than the tokenizer alone here) and rewrites the process's environment (``LD_LIBRARY_PATH``,
``KMP_*``, ``TORCHINDUCTOR_*``). What it does to a text conversation before and around the
template is reproduced instead, and ``tests/unit/test_kv_chat.py`` compares the tokens with
vLLM's own renderer:

- the content format (vLLM's ``auto``): ``openai`` when the template loops over a message's
  content (directly or through a macro parameter), where text parts are passed as
  ``{"type": "text", "text": ...}`` (a string content as one such part); else ``string``, where
  they are joined with newlines;
- only the message fields vLLM passes on; an assistant's tool-call ``arguments`` (a JSON string
  in OpenAI's format) parsed into an object (``{}`` when empty, invalid or not an object);
- ``developer`` turns become ``system`` turns when the template never names that role, and the
  system turns are then merged into one, first;
- tools as vLLM's request model dumps them (``description`` and ``parameters`` always present);
- the template's arguments: ``chat_template_kwargs``, overridden by the request's
  ``add_generation_prompt`` (default true), ``continue_final_message``, ``documents`` and
  ``reasoning_effort`` (which also sets ``enable_thinking`` unless given); then the text is
  tokenized with ``add_special_tokens`` as the request says (default false).

A request the engine would render otherwise (its own ``chat_template``, media parts) gets no
tokens: it is routed by load.
"""

from __future__ import annotations

import json
from collections import deque
from functools import lru_cache
from typing import Any

__all__ = ["Unrenderable", "chat_tokens", "content_format"]

TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking"}
# fields of vLLM's content-part types; a text part's other fields reach an ``openai`` template
KNOWN_PART_FIELDS = frozenset(
    "audio_embeds audio_url closed data file image_embeds image_pil image_url input_audio name "
    "prompt_cache_breakpoint refusal text thinking type uuid video_embeds video_url".split()
)
BILLING_HEADER = "x-anthropic-billing-header"  # Claude Code's per-request line, dropped by vLLM


class Unrenderable(ValueError):
    """The engine would not render this request as the gateway can (or would refuse it)."""


def chat_tokens(tok: Any, kind: str, body: dict[str, Any]) -> list[int]:
    """The engine's prompt tokens for a chat (``chat``) or Anthropic Messages (``messages``) body."""
    messages = _anthropic(body) if kind == "messages" else body.get("messages")
    if not isinstance(messages, list):
        raise Unrenderable("no messages")
    kwargs = _template_kwargs(body)
    tools = kwargs.pop("tools", None)
    for passed in ("tokenize", "return_dict"):
        kwargs.pop(passed, None)
    template = tok.get_chat_template(None, tools=tools)
    openai, developer = _template_traits(template)
    conversation = [_message(m, openai) for m in messages]
    _parse_tool_arguments(conversation)
    if not developer and any(m["role"] == "developer" for m in conversation):
        conversation = _merge_system([_as_system(m) if m["role"] == "developer" else m for m in conversation])
    text = tok.apply_chat_template(
        conversation, tools=tools, chat_template=template, tokenize=False, return_dict=False, **kwargs
    )
    return list(tok(text, add_special_tokens=bool(body.get("add_special_tokens", False)))["input_ids"])


def _template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """``ChatCompletionRequest.build_chat_params`` with the serving defaults merged under it."""
    user = body.get("chat_template_kwargs") or {}
    if not isinstance(user, dict) or body.get("chat_template") is not None or "chat_template" in user:
        raise Unrenderable("a request's own chat template")  # refused by the engine unless trusted
    effort = body.get("reasoning_effort")
    extra = {
        "add_generation_prompt": body.get("add_generation_prompt", True),
        "continue_final_message": body.get("continue_final_message", False),
        "documents": body.get("documents"),
        "reasoning_effort": effort,
    }
    if effort is not None and "enable_thinking" not in user:
        extra["enable_thinking"] = effort != "none"
    tools = body.get("tools")
    defaults = {"tools": None if tools is None else [_tool(t) for t in tools], "tokenize": False}
    return _merge(defaults, _merge(user, extra))


def _merge(defaults: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``merge_kwargs``: an override of None or "auto" leaves the default."""
    return defaults | {k: v for k, v in overrides.items() if not (v is None or (isinstance(v, str) and v == "auto"))}


def _tool(tool: Any) -> dict[str, Any]:
    """A tool as vLLM's ``ChatCompletionToolsParam.model_dump()`` gives it to the template."""
    f = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(f, dict) or tool.get("type", "function") != "function":
        raise Unrenderable("a tool vLLM would refuse")
    defer = tool.get("defer_loading")
    fn = {"name": f.get("name"), "description": f.get("description"), "parameters": f.get("parameters")}
    if f.get("strict") is not None:
        fn["strict"] = f["strict"]
    f_defer = f.get("defer_loading")
    if (f_defer if f_defer is not None else defer) is not None:
        fn["defer_loading"] = f_defer if f_defer is not None else defer
    out: dict[str, Any] = {"type": "function", "function": fn}
    if defer is not None:
        out["defer_loading"] = defer
    return out


def _message(m: Any, openai: bool) -> dict[str, Any]:
    """vLLM's ``_parse_chat_message_content`` for a text message."""
    role = m.get("role") if isinstance(m, dict) else None
    if not isinstance(role, str):
        raise Unrenderable("a message without a role")
    out: dict[str, Any] = {"role": role, "content": _content(role, m.get("content"), openai)}
    if role == "assistant":
        calls = m.get("tool_calls")
        if calls is not None:  # copied: their arguments are parsed in place
            out["tool_calls"] = [
                {**c, "function": dict(c["function"])}
                if isinstance(c, dict) and isinstance(c.get("function"), dict)
                else c
                for c in calls
            ]
        if m.get("reasoning") is not None:
            out["reasoning"] = out["reasoning_content"] = m["reasoning"]
    elif role == "tool":
        if "tool_call_id" in m:
            out["tool_call_id"] = m["tool_call_id"]
        parts = out["content"]
        if isinstance(parts, list) and not any(isinstance(p, dict) and p.get("type") != "text" for p in parts):
            out["content"] = "\n".join(
                p.get("text", "") for p in parts if isinstance(p, dict) and p.get("type") == "text"
            )
    for field in ("name", "task"):
        if isinstance(m.get(field), str):
            out[field] = m[field]
    if role == "developer":
        out["tools"] = m.get("tools")
    return out


def _content(role: str, content: Any, openai: bool) -> str | list[Any]:
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = content
    else:
        raise Unrenderable("unreadable content")
    if role == "system":
        parts = _without_billing_header(parts)
    out: list[Any] = []
    for part in parts:
        if isinstance(part, str):
            out.append({"type": "text", "text": part} if openai else part)
            continue
        kind = part.get("type") if isinstance(part, dict) and part.get("uuid") is None else None
        if kind in TEXT_PARTS:
            text = part.get(TEXT_PARTS[kind])
            if text is None and kind in ("text", "refusal"):
                continue  # vLLM skips an empty part
            if not isinstance(text, str):
                raise Unrenderable("an unreadable text part")
            extra = {k: v for k, v in part.items() if k not in KNOWN_PART_FIELDS}
            out.append({"type": "text", "text": text, **extra} if openai else text)
        elif kind == "tool_reference" and isinstance(part.get("name"), str):
            out.append({"type": "tool_reference", "name": part["name"]} if openai else part["name"])
        else:  # media (the engine's processor expands them) or a part the engine refuses
            raise Unrenderable("a non-text content part")
    return out if openai else "\n".join(out)


def _without_billing_header(parts: list[Any]) -> list[Any]:
    out = []
    for part in parts:
        text = (
            part
            if isinstance(part, str)
            else part.get("text")
            if isinstance(part, dict) and part.get("type") == "text"
            else None
        )
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _parse_tool_arguments(conversation: list[dict[str, Any]]) -> None:
    """vLLM's ``_postprocess_messages``: tool-call arguments as objects, as templates expect."""
    for m in conversation:
        calls = m.get("tool_calls") if m["role"] == "assistant" else None
        if not isinstance(calls, list):
            continue
        if not calls:
            del m["tool_calls"]
            continue
        for call in calls:
            f = call.get("function") if isinstance(call, dict) else None
            if not isinstance(f, dict) or call.get("type", "function") != "function":
                raise Unrenderable("a tool call vLLM refuses")
            args = f.get("arguments")
            if not args:
                f["arguments"] = {}
                continue
            parsed = args
            if isinstance(args, str):
                try:
                    parsed = json.loads(args)
                except json.JSONDecodeError:
                    parsed = None
            f["arguments"] = parsed if isinstance(parsed, dict) else {}


def _as_system(m: dict[str, Any]) -> dict[str, Any]:
    return {k: ("system" if k == "role" else v) for k, v in m.items() if k != "tools"}


def _merge_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's ``_consolidate_system_messages``: the system turns as one, first."""
    texts: list[str] = []
    rest: list[dict[str, Any]] = []
    merge = False
    for i, m in enumerate(conversation):
        if m["role"] != "system":
            rest.append(m)
            continue
        merge = merge or i > 0 or bool(texts)
        content = m.get("content", "")
        if isinstance(content, list):
            content = "\n".join(
                str(p["text"]) if isinstance(p, dict) else p
                for p in content
                if (isinstance(p, dict) and "text" in p) or isinstance(p, str)
            )
        if content:
            texts.append(content)
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest] if merge else conversation


def _anthropic(body: dict[str, Any]) -> list[dict[str, Any]]:
    """An Anthropic Messages body as chat turns, text blocks only (vLLM converts its other blocks
    too; the prefix before the first of them still keys right)."""
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if isinstance(system, list):
        system = "".join(
            b["text"]
            for b in system
            if isinstance(b, dict)
            and b.get("type") == "text"
            and b.get("text")
            and not b["text"].startswith(BILLING_HEADER)
        )
    if system:
        out.append({"role": "system", "content": system})
    for m in body.get("messages") or ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            texts = [b for b in content if isinstance(b, dict) and b.get("type") == "text" and b.get("text")]
            content = texts[0]["text"] if len(texts) == 1 else texts
        out.append({**m, "content": content})
    return out


@lru_cache(maxsize=32)
def _template_traits(template: str) -> tuple[bool, bool]:
    """(content format is ``openai``, the template names the ``developer`` role)."""
    return content_format(template) == "openai", '"developer"' in template or "'developer'" in template


def content_format(template: str) -> str:
    """vLLM's ``auto`` content format of a chat template (``_detect_content_format``): ``openai``
    when it loops over a message's ``content``, or over a macro parameter given one, or over a
    variable named ``content`` outside macros; ``string`` otherwise, or when unsure."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        root = _compile_jinja_template(template).environment.parse(template)
        return "openai" if _loops_over_content(root) else "string"
    except Exception:  # noqa: BLE001 - vLLM falls back to string too
        return "string"


def _loops_over_content(root: Any) -> bool:
    from jinja2 import nodes

    def target(loop: Any) -> str:
        if not isinstance(loop.target, nodes.Name):
            raise ValueError("unpacking loop target")  # vLLM's assertion: format unknown, string
        return str(loop.target.name)

    names, seen, queue = ["messages"], {"messages"}, deque(["messages"])
    while queue:  # variables set from messages (slices, filters) count as messages too
        var = queue.popleft()
        for a in root.find_all(nodes.Assign):
            if _access(a.node, var):
                if not isinstance(a.target, nodes.Name):
                    raise ValueError("unpacking assignment")
                names.append(a.target.name)
                if a.target.name not in seen:
                    seen.add(a.target.name)
                    queue.append(a.target.name)
    message_vars = [target(loop) for loop in root.find_all(nodes.For) if any(_access(loop.iter, v) for v in names)]
    by_loop: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in root.find_all(nodes.Macro):
        params = [a.name for a in macro.args]
        given: set[str] = set()
        for call in root.find_all(nodes.Call):
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(params) and any(_access(arg, v, "content") for v in message_vars):
                    given.add(params[i])
            for kw in call.kwargs:
                if kw.key in params and any(_access(kw.value, v, "content") for v in message_vars):
                    given.add(kw.key)
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if given:
                by_loop[id(loop)] = given
    for loop in root.find_all(nodes.For):
        it = loop.iter
        if (
            any(_access(it, v, "content") for v in message_vars)
            or (isinstance(it, nodes.Name) and it.name in by_loop.get(id(loop), ()))
            or (id(loop) not in in_macros and isinstance(it, nodes.Name) and it.name == "content")
        ):
            target(loop)
            return True
    return False


def _access(node: Any, var: str, key: str | None = None) -> bool:
    """``var`` (or ``var.key`` / ``var[key]``), possibly through filters, tests and slices."""
    from jinja2 import nodes

    while True:
        if isinstance(node, nodes.Filter) and node.node is not None:
            node = node.node
        elif isinstance(node, nodes.Test) or (isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)):
            node = node.node
        elif isinstance(node, nodes.Filter):
            return False
        else:
            break

    def named(n: Any) -> bool:
        return isinstance(n, nodes.Name) and n.ctx == "load" and n.name == var

    if key is None:
        return named(node)
    if isinstance(node, nodes.Getitem):
        return named(node.node) and isinstance(node.arg, nodes.Const) and node.arg.value == key
    return isinstance(node, nodes.Getattr) and named(node.node) and node.attr == key
