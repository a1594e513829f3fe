"""Byte-level BPE tokenizers trained locally, and the one way training turns rows into token ids.

Why byte-level BPE: any UTF-8 text (JSON, tool schemas, emoji, other scripts) round-trips, so the
whole chat surface -- structured output, tools, roles -- can be served, and a grammar-constrained
decoder (``response_format: json_object``) finds tokens for every character it needs.

Pre-tokenization, in order:

* runs of newlines are isolated, so the ``\\n``/``\\n\\n`` that ends a chat template's generation
  prompt is its own token and the first token of an answer never merges with it (the tokens the
  model is trained on after the prompt are the tokens it has to generate after it);
* every digit is its own piece (``Digits(individual_digits=True)``), which keeps arithmetic
  learnable by a tiny model and stops the first digit of an answer merging with the prompt;
* ``ByteLevel(use_regex=False)``: the GPT-2 word regex is off, so BPE may merge across spaces and
  punctuation. Template fragments and tool JSON (``{"name": "add", "arguments": {"a": ``) then
  compress into a few tokens, which keeps rows short enough to train on two CPU cores.

Special tokens (BOS, end of turn, padding, role headers) are split out before BPE and never merged.
Tokens such as ``<tool_call>`` are added as *non-special* tokens, as Qwen2.5 does: they are atomic
for the model, vLLM's hermes tool parser finds them in the text, and they survive detokenization
with ``skip_special_tokens=True``.

BOS: a family that has one writes it in its chat template *and* has the post-processor prepend it
when special tokens are requested, because vLLM tokenizes a rendered chat without special tokens
and a ``/v1/completions`` prompt with them; both then start with exactly one BOS.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

__all__ = [
    "DEFAULT_VOCAB_SIZE",
    "TOOL_TOKENS",
    "TokenizerSpec",
    "save_tokenizer",
    "train_tokenizer",
]

DEFAULT_VOCAB_SIZE: Final = 1536
# Non-special added tokens shared by every family: Hermes-style tool markup.
TOOL_TOKENS: Final = ("<tool_call>", "</tool_call>", "<tools>", "</tools>", "<tool_response>", "</tool_response>")


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    """The fixed tokens and template of one model family; BPE learns everything else.

    ``special_tokens`` get the first ids in this order; ``bos`` (if not ``None``) is prepended by
    the post-processor when special tokens are requested (``/v1/completions``); ``eos`` is the
    end-of-turn token, the one generation stops on. ``split_regex`` replaces the compact
    pre-tokenization with a word-splitting regex + NFC normalizer, for a family whose tokenizer
    class transformers rebuilds from vocab and merges (it must be the regex that class uses, or
    the loaded tokenizer would split text differently from the one trained here).
    """

    special_tokens: tuple[str, ...]
    bos: str | None
    eos: str
    pad: str
    chat_template: str
    model_max_length: int
    split_regex: str | None = None


def _strip_fixed_tokens(texts: Iterable[str], fixed: Sequence[str]) -> Iterator[str]:
    """The pieces of ``texts`` between fixed tokens: BPE must not learn merges inside them."""
    pattern = re.compile("|".join(re.escape(tok) for tok in sorted(fixed, key=len, reverse=True)))
    for text in texts:
        yield from (piece for piece in pattern.split(text) if piece)


def _pre_tokenizer(split_regex: str | None) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if split_regex is not None:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split_regex), behavior="isolated"), byte_level])
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\n+"), behavior="isolated"),
            pre_tokenizers.Digits(individual_digits=True),
            byte_level,
        ]
    )


def train_tokenizer(
    corpus: Iterable[str], spec: TokenizerSpec, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``corpus`` (rendered training text) and wrap it for transformers.

    Training is deterministic for a given corpus order. The vocabulary may end below
    ``vocab_size`` when the corpus has no more pairs worth merging (a generated corpus is small).
    """
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = _pre_tokenizer(spec.split_regex)
    if spec.split_regex is not None:
        core.normalizer = normalizers.NFC()
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(spec.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(_strip_fixed_tokens(corpus, (*spec.special_tokens, *TOOL_TOKENS)), trainer)
    core.add_special_tokens([AddedToken(tok, special=True, normalized=False) for tok in spec.special_tokens])
    core.add_tokens([AddedToken(tok, special=False, normalized=False) for tok in TOOL_TOKENS])
    if spec.bos is not None:
        core.post_processor = processors.TemplateProcessing(
            single=f"{spec.bos} $A",
            pair=f"{spec.bos} $A $B",
            special_tokens=[(spec.bos, core.token_to_id(spec.bos))],
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=spec.bos,
        eos_token=spec.eos,
        pad_token=spec.pad,
        model_max_length=spec.model_max_length,
        padding_side="left",
        chat_template=spec.chat_template,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, directory: str | Path) -> None:
    """``save_pretrained`` ``tokenizer`` into ``directory`` so any transformers/vLLM loads it.

    transformers 5 records ``tokenizer_class: TokenizersBackend`` and keeps the chat template only
    in ``chat_template.jinja``; the config is rewritten with the class name every transformers
    release knows and the template inlined, so older stacks (e.g. a GPU image) load it too.
    """
    tokenizer.save_pretrained(str(directory))
    config_path = Path(directory) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config |= {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": tokenizer.chat_template}
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
