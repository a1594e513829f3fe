"""A character-level tokenizer for the arithmetic models, saved in Hugging Face format.

Why character-level: one token per digit and sign makes arithmetic learnable by a tiny model, and
the vocabulary is small enough to write down. It is a ``tokenizers`` WordLevel model over single
characters wrapped in ``PreTrainedTokenizerFast`` so that transformers and vLLM load it from
``save_pretrained`` output without custom code. Characters outside the vocabulary map to ``<unk>``
instead of failing.

The chat template renders only the concatenated message contents after ``<bos>``: a user message
``"37+45="`` becomes exactly the prompt the model was trained on, and ``add_generation_prompt``
adds nothing, so ``/v1/chat/completions`` and ``/v1/completions`` see the same tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Final

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

__all__ = [
    "BOS",
    "CHAT_TEMPLATE",
    "EOS",
    "PAD",
    "UNK",
    "VOCAB",
    "build_tokenizer",
    "save_tokenizer",
]

PAD: Final = "<pad>"
BOS: Final = "<bos>"
EOS: Final = "<eos>"
UNK: Final = "<unk>"
SPECIAL_TOKENS: Final = (PAD, BOS, EOS, UNK)
CHARACTERS: Final = tuple("0123456789+-=* ")
VOCAB: Final[dict[str, int]] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
MODEL_MAX_LENGTH: Final = 64

# Jinja, rendered by transformers and by vLLM's chat endpoint. String contents only: the
# arithmetic models have no roles, so system/user/assistant text is simply concatenated.
CHAT_TEMPLATE: Final = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The tokenizer every arithmetic model uses: ``<bos>`` prepended, no ``<eos>`` appended."""
    core = Tokenizer(models.WordLevel(vocab=dict(VOCAB), unk_token=UNK))
    # Every character is its own piece (newlines too, so they become <unk>).
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A $B",
        special_tokens=[(BOS, VOCAB[BOS])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=MODEL_MAX_LENGTH,
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(directory: str | Path) -> PreTrainedTokenizerFast:
    """Build the tokenizer and ``save_pretrained`` it into ``directory``; returns it.

    transformers 5 records ``tokenizer_class: TokenizersBackend`` and keeps the chat template only
    in ``chat_template.jinja``; the config is rewritten with the class name every transformers
    release knows and the template inlined, so older stacks (e.g. a GPU image) load it too.
    """
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(str(directory))
    config_path = Path(directory) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config |= {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE}
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return tokenizer
