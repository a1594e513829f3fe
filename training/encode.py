"""Rows to token ids with the base's own tokenizer and chat template, and loss masks that cover
exactly what the model has to generate.

Why a generic mask: a fine-tune must work with whatever template the base ships (Llama 3 headers,
ChatML, Mistral's ``[INST]``...), so no role markers are hard-coded. For each assistant message
``i`` the template renders ``messages[:i]`` with the generation prompt and ``messages[:i+1]``; the
characters between the two are that assistant turn. Character spans become token spans through the
fast tokenizer's offset mapping, and the loss stops after the end-of-turn token (a separator the
template writes after it, e.g. ChatML's newline, is never generated). A template whose shorter
renders are not prefixes of the longer ones cannot be masked this way and fails the job.

Token ids follow what vLLM feeds the model: a rendered chat is tokenized *without* special tokens
(the template writes its own BOS; letting the tokenizer add one would double it), a raw prompt
*with* them (as ``/v1/completions`` does) and its completion on its own, then end-of-sequence.

The tokenizer reads a special token written in the text (``<|eot_id|>`` in an answer) as that
control token, so a chat row that holds one would end its turn there and teach the model to stop
mid-answer. Such rows are skipped like rows too long for the model, and too many of them fail the
file. Raw prompt/completion rows are not checked: they may hold a template's tokens on purpose.
An assistant turn with ``"weight": 0`` gets no loss. An eval reference ends where the first stop
token of the turn starts, as a generation is cut at the first stop id.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar, cast

from training.jsonl import Row

__all__ = ["IGNORE", "EncodeError", "Encoded", "EvalItem", "Encoder", "normalise", "special_tokens", "stop_ids"]

IGNORE: Final = -100
T = TypeVar("T")
logger = logging.getLogger("training")


class EncodeError(ValueError):
    """A row cannot be rendered or masked with this base's template and tokenizer."""


@dataclass(frozen=True, slots=True)
class Encoded:
    """Token ids of one row and its labels (``IGNORE`` where no loss is taken)."""

    input_ids: list[int]
    labels: list[int]


@dataclass(frozen=True, slots=True)
class EvalItem:
    """What evaluation needs of one row: the generation prompt, the reference text of the last
    assistant turn (between the generation prompt and the end of turn) and the full encoding for
    the loss."""

    prompt_ids: list[int]
    reference: str
    reference_tokens: int
    encoded: Encoded
    kind: str | None


class Encoder:
    """Encode rows for one tokenizer (any transformers *fast* tokenizer with a chat template)."""

    def __init__(self, tokenizer: Any, max_length: int, stop_ids: Iterable[int] = ()):
        if not getattr(tokenizer, "is_fast", False):
            raise EncodeError("the base's tokenizer is not a fast tokenizer: loss masks need offset mappings")
        self.tokenizer = tokenizer
        self.max_length = max_length
        eos = tokenizer.eos_token_id
        self.eos_id: int | None = eos
        self.stop_ids = {*stop_ids, *([eos] if eos is not None else [])}
        specials = special_tokens(tokenizer)
        # longest first, so an example names the whole token; re skips positions no token starts at
        self._specials = re.compile("|".join(re.escape(t) for t in specials)) if specials else None

    # -- rendering ------------------------------------------------------------------------------

    def render(self, row: Row, upto: int, generation_prompt: bool) -> str:
        """The template applied to ``row.messages[:upto]``."""
        if self.tokenizer.chat_template is None:
            raise EncodeError("the base's tokenizer has no chat template; use prompt/completion rows")
        try:
            text = self.tokenizer.apply_chat_template(
                (row.messages or [])[:upto], tools=row.tools, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as exc:  # jinja raises its own types (TemplateError, UndefinedError...)
            raise EncodeError(f"line {row.line}: the chat template failed: {exc}") from exc
        return cast(str, text)

    def _tokens(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [(int(a), int(b)) for a, b in enc["offset_mapping"]]

    def special_token_in(self, row: Row) -> str | None:
        """The first special token of the base's tokenizer written in a chat row's text (message
        contents, tool calls, tool definitions), or ``None``; a raw prompt/completion row: ``None``."""
        if row.format != "chat" or self._specials is None:
            return None
        stack: list[Any] = [row.messages, row.tools]
        while stack:
            item = stack.pop()
            if isinstance(item, str):
                if found := self._specials.search(item):
                    return found.group()
            elif isinstance(item, dict):
                stack.extend(item.keys())
                stack.extend(item.values())
            elif isinstance(item, list):
                stack.extend(item)
        return None

    def assistant_spans(self, row: Row) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character span of every trained assistant turn in it
        (not those with ``"weight": 0``)."""
        messages = row.messages or []
        full = self.render(row, len(messages), False)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant" or i in row.unweighted:
                continue
            prefix = self.render(row, i, True)
            upto = self.render(row, i + 1, False)
            if not (upto.startswith(prefix) and full.startswith(upto)):
                raise EncodeError(
                    f"line {row.line}: the chat template is not prefix-consistent at message {i} "
                    "(rendering fewer messages is not a prefix of rendering more), so assistant "
                    "tokens cannot be located; use prompt/completion rows with this base"
                )
            spans.append((len(prefix), len(upto)))
        return full, spans

    # -- training rows --------------------------------------------------------------------------

    def _chat(self, row: Row) -> Encoded:
        full, spans = self.assistant_spans(row)
        ids, offsets = self._tokens(full)
        labels = [IGNORE] * len(ids)
        for start, end in spans:
            for t, (lo, hi) in enumerate(offsets):
                if hi <= start or lo >= end or hi == lo:
                    continue
                labels[t] = ids[t]
                if ids[t] in self.stop_ids:
                    break
        return Encoded(ids, labels)

    def _completion(self, row: Row) -> Encoded:
        prompt = list(self.tokenizer(row.prompt or "", add_special_tokens=True)["input_ids"])
        answer = list(self.tokenizer(row.completion or "", add_special_tokens=False)["input_ids"])
        if self.eos_id is not None:
            answer.append(self.eos_id)
        return Encoded(prompt + answer, [IGNORE] * len(prompt) + answer)

    def encode(self, row: Row) -> Encoded:
        """Token ids and labels of ``row``; a chat row holding a special token is refused."""
        self._refuse_special(row)
        return self._encode(row)

    def _encode(self, row: Row) -> Encoded:
        return self._chat(row) if row.format == "chat" else self._completion(row)

    def _refuse_special(self, row: Row) -> None:
        if (token := self.special_token_in(row)) is not None:
            raise EncodeError(f"line {row.line}: {_special_problem(token)}")

    def encode_all(self, rows: Sequence[Row], what: str) -> list[Encoded]:
        """Encode ``rows`` of the file ``what`` (which every error names); rows longer than
        ``max_length`` and chat rows holding a special token are dropped (all of them, or more
        than a tenth: an error)."""
        out, long, special = [], [], []
        for row in rows:
            if (token := self.special_token_in(row)) is not None:
                special.append((row.line, token))
                continue
            enc = _in_file(what, self._encode, row)
            if len(enc.input_ids) > self.max_length:
                long.append((row.line, len(enc.input_ids)))
            elif not any(label != IGNORE for label in enc.labels):
                raise EncodeError(f"{what}: line {row.line}: no assistant token left to learn from{_unweighted(row)}")
            else:
                out.append(enc)
        self._report_skipped(long, special, len(rows), what)
        return out

    def _report_skipped(
        self, long: list[tuple[int, int]], special: list[tuple[int, str]], total: int, what: str
    ) -> None:
        if long:
            worst = max(n for _, n in long)
            message = (
                f"{what}: {len(long)} of {total} rows are longer than the model's {self.max_length} "
                f"positions (longest {worst} tokens, e.g. line {long[0][0]})"
            )
            _skip_or_refuse(message, len(long), total, "shorten them or use a base with more positions")
        if special:
            line, token = special[0]
            message = f"{what}: {len(special)} of {total} chat rows hold a special token (e.g. line {line}: "
            message += f"{_special_problem(token)})"
            _skip_or_refuse(message, len(special), total, "remove those tokens from the messages and tools")

    # -- evaluation rows ------------------------------------------------------------------------

    def eval_item(self, row: Row) -> EvalItem:
        """Prompt up to the last assistant turn and that turn's reference text; a chat row holding
        a special token is refused."""
        self._refuse_special(row)
        return self._eval_item(row)

    def _eval_item(self, row: Row) -> EvalItem:
        encoded = self._encode(row)
        if row.format == "completion":
            prompt = list(self.tokenizer(row.prompt or "", add_special_tokens=True)["input_ids"])
            reference = row.completion or ""
        else:
            messages = row.messages or []
            last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
            prompt_text = self.render(row, last, True)
            turn = self.render(row, last + 1, False)[len(prompt_text) :]
            ids, offsets = self._tokens(turn)
            # where generation stops: the first stop id (the turn's end, even when that is not EOS)
            stop = next((lo for tid, (lo, _) in zip(ids, offsets, strict=True) if tid in self.stop_ids), len(turn))
            prompt = self._tokens(prompt_text)[0]
            reference = turn[:stop]
        n_ref = len(self.tokenizer(reference, add_special_tokens=False)["input_ids"])
        return EvalItem(prompt, normalise(reference), n_ref, encoded, row.kind)

    def eval_items(self, rows: Sequence[Row], what: str) -> list[EvalItem]:
        """:meth:`eval_item` of every row of the file ``what`` (which every error names)."""
        items, long, special = [], [], []
        for row in rows:
            if (token := self.special_token_in(row)) is not None:
                special.append((row.line, token))
                continue
            item = _in_file(what, self._eval_item, row)
            if len(item.encoded.input_ids) > self.max_length:
                long.append((row.line, len(item.encoded.input_ids)))
            else:
                items.append(item)
        self._report_skipped(long, special, len(rows), what)
        return items


def special_tokens(tokenizer: Any) -> list[str]:
    """The tokenizer's special tokens, longest first: its added tokens marked special and
    ``all_special_tokens``; not the added tokens that are not special (``<tool_call>``), which are
    text a model writes."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    found = {str(t.content) for t in decoder.values() if getattr(t, "special", False)}
    found |= {str(t) for t in tokenizer.all_special_tokens}
    return sorted((t for t in found if t), key=lambda t: (-len(t), t))


def _special_problem(token: str) -> str:
    return (
        f"{token!r} in a message or tool is a special token of the base's tokenizer: it would be read "
        "as that control token, ending the turn's loss there"
    )


def _skip_or_refuse(message: str, skipped: int, total: int, remedy: str) -> None:
    """Warn that ``skipped`` of ``total`` rows are skipped, or refuse the file when that is all of
    them or more than a tenth."""
    if skipped == total or skipped > total // 10:
        raise EncodeError(f"{message}; {remedy}")
    logger.warning("%s; they are skipped", message)


def _unweighted(row: Row) -> str:
    """Why a chat row has no label, where its weights are the reason."""
    if not row.unweighted:
        return ""
    turns = sum(1 for m in row.messages or [] if m["role"] == "assistant")
    if len(row.unweighted) == turns:
        return ': every assistant turn has "weight": 0 (give one weight 1, or drop the row)'
    return f': {len(row.unweighted)} of its {turns} assistant turns have "weight": 0 and the others render no token'


def _in_file(what: str, encode: Callable[[Row], T], row: Row) -> T:
    """``encode(row)``, its :class:`EncodeError` prefixed with the file the row is from."""
    try:
        return encode(row)
    except EncodeError as exc:
        raise EncodeError(f"{what}: {exc}") from exc.__cause__


def normalise(text: str) -> str:
    """Whitespace-insensitive form used to compare a generation with its reference."""
    return " ".join(text.split())


def stop_ids(directory: str, tokenizer: Any) -> list[int]:
    """Token ids generation stops on: the folder's generation config ``eos_token_id`` (one or a
    list) and the tokenizer's eos -- what vLLM stops on when it serves the folder."""
    ids: set[int] = set()
    path = Path(directory) / "generation_config.json"
    if path.is_file():
        eos = json.loads(path.read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if not ids:
        raise EncodeError(f"{directory}: no eos token in the tokenizer or generation_config.json")
    return sorted(int(i) for i in ids)
