"""What admission reserves against a tenant's TPM: the most tokens a request may be billed,
bounded from its body alone (the gateway does not tokenize). Pure; imports nothing from ray or vllm.

Prompt: exact when it is token ids. A text counts its UTF-8 bytes: every token of a byte-level
BPE tokenizer (Llama 3, Qwen, GPT-2 style), of SentencePiece with byte fallback (Llama 2,
Mistral) or of WordPiece covers at least one byte, so a text has no more tokens than bytes,
whatever it holds: English (about 4 bytes a token, so reserved about 4x), code, digits or emoji
(down to 1). A text prompt of completions or embeddings adds :data:`SPECIAL_TOKENS` (BOS, or
CLS and SEP). A chat-like prompt (chat's messages, Responses' input and instructions, Messages'
system and messages, with their tools) counts the bytes of its JSON, whose keys and quotes (at
least 20 bytes a message) cover what a chat template adds per message (under 10 tokens), plus
:data:`TEMPLATE_TOKENS` for what it adds once (BOS, a default system prompt, the generation
prompt); a template that adds more text than that is where the bound can fall short. A prompt with
an image, audio, video or file part reserves the context length (those tokens are the processor's).

Completion: ``n`` completions of at most the request's token limit per prompt. vLLM keeps each
sequence (the prompt and one completion) within the context length, so the reservation of one
prompt is at most that bound too (:func:`reservation`); a longer prompt is refused, unbilled.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

__all__ = ["SPECIAL_TOKENS", "TEMPLATE_TOKENS", "chat_bound", "reservation", "text_bounds"]

SPECIAL_TOKENS = 4  # a text prompt's special tokens: BOS, CLS and SEP, SentencePiece's leading space
TEMPLATE_TOKENS = 64  # what a chat template adds once: BOS, a default system prompt, the generation prompt
# content parts whose tokens the model's processor makes (not their bytes): by type, or by key
# when untyped (vLLM takes {"image_url": ...} without a type)
MEDIA_TYPES = frozenset(
    {"image_url", "input_image", "image", "input_audio", "audio_url", "video_url", "input_file", "file", "document"}
)
MEDIA_KEYS = frozenset({"image_url", "input_audio", "audio_url", "video_url", "image_embeds", "audio_embeds"})


def _bytes(s: str) -> int:
    return len(s) if s.isascii() else len(s.encode())


def _token_ids(v: list[Any]) -> bool:
    return bool(v) and all(isinstance(t, int) for t in v)


def text_bounds(prompt: object) -> list[int]:
    """One bound per prompt of a completions ``prompt`` or an embeddings ``input`` (OpenAI's four
    forms: a string, or an array of strings, of token ids or of token id arrays)."""
    if isinstance(prompt, str):
        return [_bytes(prompt) + SPECIAL_TOKENS]
    if not isinstance(prompt, list):
        return []
    if _token_ids(prompt):
        return [len(prompt)]
    return [b for p in prompt for b in text_bounds(p)]


def _has_media(v: object) -> bool:
    if isinstance(v, dict):
        if v.get("type") in MEDIA_TYPES or not MEDIA_KEYS.isdisjoint(v):
            return True
        return any(_has_media(x) for x in v.values() if isinstance(x, (dict, list)))
    if isinstance(v, list):
        return any(_has_media(x) for x in v if isinstance(x, (dict, list)))
    return False


def chat_bound(parts: Iterable[object], context: int) -> int:
    """The bound of a chat-like prompt made of ``parts`` (the body's prompt fields; None: absent)."""
    present = [p for p in parts if p is not None]
    if _has_media(present):
        return context
    return len(msgspec.json.encode(present)) + TEMPLATE_TOKENS


def reservation(prompts: Iterable[int], limit: int, n: int, context: int) -> tuple[int, int]:
    """(prompt, completion) tokens to reserve for prompts of at most ``prompts`` tokens each, each
    with ``n`` completions of at most ``limit`` tokens, every sequence within ``context`` tokens.

    Per prompt: ``c = min(limit, context)`` and ``min(prompt, context - c) + n * c``. A prompt of
    ``p`` tokens is billed ``p + n * min(limit, context - p)``, which grows with ``p`` up to
    ``context - c`` and no further (beyond, each completion loses what the prompt gains), so this is
    its most; with ``n`` = 1 it is ``min(prompt + limit, context)``."""
    c = max(0, min(limit, context))
    prompt = completion = 0
    for bound in prompts:
        prompt += min(bound, context - c)
        completion += n * c
    return prompt, completion
