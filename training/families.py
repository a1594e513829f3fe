"""Model families (architecture + tokenizer + chat template) and randomly initialised bases.

Why several families: ``llama`` (``LlamaForCausalLM``, Llama-3 header template) and ``qwen3``
(``Qwen3ForCausalLM``: RMS-normed queries and keys, an explicit head size; ChatML template) are the
two default local models, and they differ in every place a serving or training path could
hard-code one model: config class, special tokens, BOS (Llama prepends one, Qwen has none),
end-of-turn token, how tool results are shown. ``qwen2`` (``Qwen2ForCausalLM``, qkv bias, ChatML)
stays available as a base. transformers 5 loads every ``qwen2`` folder's tokenizer as
``Qwen2Tokenizer``, which rebuilds it from vocab and merges with Qwen's word-splitting regex
(whatever ``tokenizer_config.json`` names), so that family's tokenizer is trained with that regex
and its tool rows are about twice as long; a ``qwen3`` folder's tokenizer loads as it was saved.
All are architectures vLLM serves natively, so ``save_pretrained`` output loads with no custom
code.

Both templates speak the Hermes tool dialect that vLLM's ``--tool-call-parser hermes`` reads: the
offered tools go into the system turn as ``<tools>{...}</tools>`` (name, description and parameters
only, so the extra ``null`` fields a server adds when it re-serialises a request do not change
the prompt; ChatML shows only the parameters' names, see ``_TOOLS_COMPACT``), and an assistant
call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
Call arguments may be a JSON string (OpenAI's wire and fine-tuning format, written verbatim) or an
object (vLLM parses the string before rendering; ``tojson`` writes ``json.dumps`` spacing), so a
row whose arguments are ``json.dumps(args)`` renders identically in training and serving. Every
turn is rendered on its own, so ``render(messages[:i], add_generation_prompt=True)`` is a prefix
of ``render(messages[:i+1])`` -- the trainer's loss masks rely on it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, NamedTuple

import torch
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_PRETOKENIZE_REGEX
from transformers.utils.chat_template_utils import render_jinja_template

from training.tokenizer import DEFAULT_VOCAB_SIZE, TokenizerSpec, save_tokenizer, train_tokenizer

__all__ = [
    "FAMILIES",
    "MAX_POSITIONS",
    "SIZES",
    "Family",
    "InitRef",
    "ModelSize",
    "build_base",
    "build_model",
    "build_tokenizer",
    "family_of",
    "parse_init_ref",
    "render",
]

MAX_POSITIONS: Final = 512
INIT_PREFIX: Final = "init:"


@dataclass(frozen=True, slots=True)
class ModelSize:
    """Shape of one size; ``head_dim`` = hidden / heads = 32 (vLLM's CPU attention needs >= 32).

    ``init_std`` is the standard deviation of the random weights (``initializer_range``), scaled
    to the width (about 0.7 / sqrt(hidden)). transformers' default, 0.02, suits widths in the
    thousands: at width 128 every projection shrinks its input to about a quarter, so the queries
    and keys of a model without normed queries and keys (Llama, Qwen2) start near zero, attention
    starts uniform, and learning waits for them to grow (docs/training.md, "Initialisation").
    """

    layers: int
    hidden: int
    intermediate: int
    heads: int
    init_std: float


SIZES: Final[dict[str, ModelSize]] = {
    "tiny": ModelSize(layers=3, hidden=128, intermediate=512, heads=4, init_std=0.06),
    "small": ModelSize(layers=4, hidden=256, intermediate=1024, heads=8, init_std=0.042),
}

# Shared Jinja pieces. Newlines the model sees are written as {{ '\n' }} so that the whitespace
# control ({%- ... %}) used to lay the template out can never eat them.
_CONTENT_MACRO: Final = (
    "{%- macro text(c) %}{% if c is string %}{{ c }}{% elif c %}{% for p in c %}"
    "{% if p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %}{% endif %}{% endmacro %}\n"
)
_SPLIT_SYSTEM: Final = (
    "{%- if messages and messages[0].role == 'system' %}{% set system = text(messages[0].content) %}"
    "{% set rest = messages[1:] %}{% else %}{% set system = '' %}{% set rest = messages %}{% endif %}\n"
)
_TOOLS: Final = (
    "{% if tools %}{% if system %}{{ '\\n\\n' }}{% endif %}<tools>{% for t in tools %}"
    "{% set f = t.function if t.function is defined else t %}"
    '{{ {"name": f.name, "description": f.description, "parameters": f.parameters} | tojson }}'
    "{% endfor %}</tools>{% endif %}"
)
_CALLS: Final = (
    "{% for tc in m.tool_calls or [] %}{% set f = tc.function if tc.function is defined else tc %}"
    '<tool_call>{"name": {{ f.name | tojson }}, "arguments": '
    "{% if f.arguments is string %}{{ f.arguments }}{% else %}{{ (f.arguments or {}) | tojson }}{% endif %}"
    "}</tool_call>{% endfor %}"
)


# The qwen2 tokenizer splits text into words and punctuation runs before BPE (Qwen2's regex), so a
# full JSON schema costs ~60 tokens a tool and dominates every tool row. The ChatML template shows
# each tool's parameter names only (``"parameters": ["a", "b"]``): about half the tokens, same
# information for a model that only ever sees integer arguments.
_TOOLS_COMPACT: Final = (
    "{% if tools %}{% if system %}{{ '\\n\\n' }}{% endif %}<tools>{% for t in tools %}"
    "{% set f = t.function if t.function is defined else t %}"
    "{% set props = (f.parameters or {}).properties or {} %}"
    '{{ {"name": f.name, "description": f.description, "parameters": props | list} | tojson }}'
    "{% endfor %}</tools>{% endif %}"
)


def _header(role: str) -> str:
    return f"<|start_header_id|>{role}<|end_header_id|>{{{{ '\\n\\n' }}}}"


LLAMA_TEMPLATE: Final = (
    _CONTENT_MACRO
    + _SPLIT_SYSTEM
    + "{{- bos_token or '' }}"
    + "{%- if system or tools %}"
    + _header("system")
    + "{{ system }}"
    + _TOOLS
    + "<|eot_id|>{% endif %}\n"
    + "{%- for m in rest %}\n"
    + "{%- if m.role == 'assistant' %}"
    + _header("assistant")
    + "{{ text(m.content) }}"
    + _CALLS
    + "<|eot_id|>\n"
    + "{%- elif m.role == 'tool' %}"
    + _header("ipython")
    + "{{ text(m.content) }}<|eot_id|>\n"
    + "{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>{{ '\\n\\n' }}{{ text(m.content) }}<|eot_id|>"
    + "{% endif %}\n"
    + "{%- endfor %}\n"
    + "{%- if add_generation_prompt %}"
    + _header("assistant")
    + "{% endif %}"
)

CHATML_TEMPLATE: Final = (
    _CONTENT_MACRO
    + _SPLIT_SYSTEM
    + "{%- if system or tools %}<|im_start|>system{{ '\\n' }}{{ system }}"
    + _TOOLS_COMPACT
    + "<|im_end|>{{ '\\n' }}{% endif %}\n"
    + "{%- for m in rest %}\n"
    + "{%- if m.role == 'assistant' %}<|im_start|>assistant{{ '\\n' }}{{ text(m.content) }}"
    + _CALLS
    + "<|im_end|>{{ '\\n' }}\n"
    + "{%- elif m.role == 'tool' %}<|im_start|>user{{ '\\n' }}<tool_response>{{ text(m.content) }}"
    + "</tool_response><|im_end|>{{ '\\n' }}\n"
    + "{%- else %}<|im_start|>{{ m.role }}{{ '\\n' }}{{ text(m.content) }}<|im_end|>{{ '\\n' }}{% endif %}\n"
    + "{%- endfor %}\n"
    + "{%- if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
)


@dataclass(frozen=True, slots=True)
class Family:
    """One architecture with its tokens and template; ``model_type`` is config.json's value."""

    name: str
    model_type: str
    tokens: TokenizerSpec
    model_class: type[PreTrainedModel]

    def config(self, size: str, vocab_size: int, ids: Mapping[str, int | None]) -> PretrainedConfig:
        """The architecture config of ``size`` over a vocabulary of ``vocab_size`` tokens."""
        if size not in SIZES:
            raise ValueError(f"unknown size {size!r}; expected one of {', '.join(SIZES)}")
        spec = SIZES[size]
        common: dict[str, Any] = {
            "vocab_size": vocab_size,
            "hidden_size": spec.hidden,
            "intermediate_size": spec.intermediate,
            "num_hidden_layers": spec.layers,
            "num_attention_heads": spec.heads,
            "max_position_embeddings": MAX_POSITIONS,
            "initializer_range": spec.init_std,
            "dtype": "float32",
            **ids,
        }
        if self.model_type == "llama":
            return LlamaConfig(num_key_value_heads=spec.heads, tie_word_embeddings=False, **common)
        if self.model_type == "qwen3":
            head_dim = spec.hidden // spec.heads
            return Qwen3Config(num_key_value_heads=spec.heads, head_dim=head_dim, tie_word_embeddings=False, **common)
        return Qwen2Config(num_key_value_heads=spec.heads, tie_word_embeddings=False, **common)


FAMILIES: Final[dict[str, Family]] = {
    "llama": Family(
        name="llama",
        model_type="llama",
        tokens=TokenizerSpec(
            special_tokens=(
                "<|begin_of_text|>",
                "<|end_of_text|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eot_id|>",
                "<|finetune_right_pad_id|>",
            ),
            bos="<|begin_of_text|>",
            eos="<|eot_id|>",
            pad="<|finetune_right_pad_id|>",
            chat_template=LLAMA_TEMPLATE,
            model_max_length=MAX_POSITIONS,
        ),
        model_class=LlamaForCausalLM,
    ),
    "qwen2": Family(
        name="qwen2",
        model_type="qwen2",
        tokens=TokenizerSpec(
            special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
            bos=None,
            eos="<|im_end|>",
            pad="<|endoftext|>",
            chat_template=CHATML_TEMPLATE,
            model_max_length=MAX_POSITIONS,
            split_regex=QWEN2_PRETOKENIZE_REGEX,
        ),
        model_class=Qwen2ForCausalLM,
    ),
    "qwen3": Family(
        name="qwen3",
        model_type="qwen3",
        tokens=TokenizerSpec(
            special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
            bos=None,
            eos="<|im_end|>",
            pad="<|endoftext|>",
            chat_template=CHATML_TEMPLATE,
            model_max_length=MAX_POSITIONS,
        ),
        model_class=Qwen3ForCausalLM,
    ),
}


class InitRef(NamedTuple):
    """A parsed ``init:<family>-<size>`` reference."""

    family: str
    size: str


def parse_init_ref(ref: str) -> InitRef:
    """``"init:llama-tiny"`` -> ``InitRef("llama", "tiny")``; ``ValueError`` for anything else."""
    if not ref.startswith(INIT_PREFIX):
        raise ValueError(f"{ref!r} is not an init reference (expected {INIT_PREFIX}<family>-<size>)")
    family, sep, size = ref[len(INIT_PREFIX) :].rpartition("-")
    if not sep or family not in FAMILIES or size not in SIZES:
        raise ValueError(
            f"bad init reference {ref!r}: expected {INIT_PREFIX}<family>-<size> with family in "
            f"{', '.join(FAMILIES)} and size in {', '.join(SIZES)}"
        )
    return InitRef(family, size)


def render(
    family: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
) -> str:
    """``family``'s chat template applied without a tokenizer (e.g. to build the BPE corpus)."""
    spec = FAMILIES[family].tokens
    schemas: list[dict[Any, Any] | Callable[..., Any]] | None = list(tools) if tools else None
    # Annotated as ``str`` upstream; it returns (rendered conversations, generation indices).
    result: Any = render_jinja_template(
        conversations=[messages],
        tools=schemas,
        chat_template=spec.chat_template,
        add_generation_prompt=add_generation_prompt,
        bos_token=spec.bos or "",
        eos_token=spec.eos,
    )
    return str(result[0][0])


def _corpus_texts(family: str, corpus: Iterable[str | Mapping[str, Any]]) -> Iterator[str]:
    """Plain strings as they are; chat rows rendered by the template; completion rows joined."""
    for item in corpus:
        if isinstance(item, str):
            yield item
        elif "messages" in item:
            yield render(family, list(item["messages"]), item.get("tools"))
        else:
            yield str(item["prompt"]) + str(item["completion"])


def build_tokenizer(
    family: str, corpus: Iterable[str | Mapping[str, Any]], vocab_size: int = DEFAULT_VOCAB_SIZE
) -> PreTrainedTokenizerFast:
    """``family``'s tokenizer with BPE merges learnt from ``corpus`` (texts or dataset rows)."""
    return train_tokenizer(_corpus_texts(family, corpus), FAMILIES[family].tokens, vocab_size)


def build_model(family: str, size: str, tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> PreTrainedModel:
    """A randomly initialised ``family``/``size`` model over ``tokenizer``'s vocabulary."""
    fam = FAMILIES[family]
    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    torch.manual_seed(seed)
    model = fam.model_class(fam.config(size, len(tokenizer), ids))
    model.generation_config = GenerationConfig(**ids, do_sample=False)
    return model


def build_base(
    directory: str | Path,
    ref: str,
    corpus: Iterable[str | Mapping[str, Any]],
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> Path:
    """Write a randomly initialised Hugging Face model folder for ``ref`` into ``directory``.

    The folder holds config.json (with ``architectures``), model.safetensors,
    generation_config.json (``eos_token_id`` = the end-of-turn token, so vLLM stops there) and the
    tokenizer files; vLLM and transformers load it with no custom code. ``corpus`` (texts or
    dataset rows) only shapes the tokenizer's merges; the weights are random from ``seed``.
    """
    family, size = parse_init_ref(ref)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(family, corpus, vocab_size)
    model = build_model(family, size, tokenizer, seed)
    model.save_pretrained(str(out))
    save_tokenizer(tokenizer, out)
    return out


def family_of(directory: str | Path) -> Family:
    """The family of a saved model folder, from config.json's ``model_type``."""
    model_type = json.loads((Path(directory) / "config.json").read_text()).get("model_type")
    for fam in FAMILIES.values():
        if fam.model_type == model_type:
            return fam
    raise ValueError(f"{directory}: model_type {model_type!r} is not one of {', '.join(FAMILIES)}")
