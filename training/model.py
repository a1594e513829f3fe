"""Model sizes, batch encoding and greedy decoding for the arithmetic Llama models.

Why Llama: it is the architecture every engine serves, so a checkpoint written by
``LlamaForCausalLM.save_pretrained`` loads in vLLM with no custom code. The sizes are chosen to
train on two CPU cores in minutes; ``small`` exists to show a visibly bigger model (about 5x the
parameters) going through the same path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, cast

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from training.data import Example
from training.tokenizer import BOS, EOS, MODEL_MAX_LENGTH, PAD, UNK, VOCAB

__all__ = [
    "SIZES",
    "ModelSize",
    "build_model",
    "encode_examples",
    "greedy_answers",
    "model_config",
]

IGNORE_INDEX: Final = -100
MAX_ANSWER_TOKENS: Final = 5  # "-99" / "198" plus <eos>, with room to spare


@dataclass(frozen=True, slots=True)
class ModelSize:
    """Architecture and default optimisation settings of one size."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    steps: int
    batch_size: int = 128
    peak_lr: float = 3e-3


SIZES: Final[dict[str, ModelSize]] = {
    "tiny": ModelSize(layers=3, hidden=128, intermediate=512, heads=4, steps=1200),
    "small": ModelSize(layers=4, hidden=256, intermediate=1024, heads=8, steps=1000, peak_lr=2e-3),
}


def model_config(size: str) -> LlamaConfig:
    """The ``LlamaConfig`` of ``size`` over the character vocabulary (float32, 64 positions)."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {', '.join(SIZES)}")
    spec = SIZES[size]
    return LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.heads,
        max_position_embeddings=MODEL_MAX_LENGTH,
        bos_token_id=VOCAB[BOS],
        eos_token_id=VOCAB[EOS],
        pad_token_id=VOCAB[PAD],
        tie_word_embeddings=False,
        dtype="float32",
    )


def build_model(size: str, seed: int = 0) -> LlamaForCausalLM:
    """A freshly initialised model of ``size``; one seed gives the same weights on every worker."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(model_config(size))
    model.generation_config = GenerationConfig(
        bos_token_id=VOCAB[BOS], eos_token_id=VOCAB[EOS], pad_token_id=VOCAB[PAD], do_sample=False
    )
    return model


def _ids(text: str) -> list[int]:
    unk = VOCAB[UNK]
    return [VOCAB.get(ch, unk) for ch in text]


def encode_examples(examples: Sequence[Example]) -> tuple[torch.Tensor, torch.Tensor]:
    """``<bos>prompt answer<eos>`` right-padded to one length, with labels only on ``answer<eos>``.

    Loss on the answer alone learns faster than loss on the whole sequence: the operands are
    random, so predicting them is pure noise in the gradient.
    """
    rows = [([VOCAB[BOS], *_ids(ex.prompt)], [*_ids(ex.answer), VOCAB[EOS]]) for ex in examples]
    length = max(len(p) + len(a) for p, a in rows)
    input_ids = torch.full((len(rows), length), VOCAB[PAD], dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    for i, (prompt, answer) in enumerate(rows):
        seq = prompt + answer
        input_ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, len(prompt) : len(seq)] = torch.tensor(answer)
    return input_ids, labels


@torch.no_grad()
def greedy_answers(model: LlamaForCausalLM, prompts: Sequence[str], batch_size: int = 256) -> list[str]:
    """Greedy completions of ``prompts`` (left-padded batches), special tokens stripped."""
    model.eval()
    inverse = {i: tok for tok, i in VOCAB.items()}
    out: list[str] = []
    for start in range(0, len(prompts), batch_size):
        chunk = [[VOCAB[BOS], *_ids(p)] for p in prompts[start : start + batch_size]]
        width = max(len(c) for c in chunk)
        ids = torch.tensor([[VOCAB[PAD]] * (width - len(c)) + c for c in chunk])
        pads = torch.tensor([width - len(c) for c in chunk])
        mask = (torch.arange(width) >= pads[:, None]).long()
        # transformers types ``generate`` through a decorator whose ``self`` mypy cannot bind
        generated = cast(Any, model).generate(
            input_ids=ids.to(model.device),
            attention_mask=mask.to(model.device),
            max_new_tokens=MAX_ANSWER_TOKENS,
            do_sample=False,
            pad_token_id=VOCAB[PAD],
            eos_token_id=VOCAB[EOS],
        )
        for row in generated[:, width:].tolist():
            text = []
            for tok in row:
                if tok in (VOCAB[EOS], VOCAB[PAD]):
                    break
                text.append(inverse[tok])
            out.append("".join(text))
    return out
