"""Score a model on evaluation rows: greedy exact match (overall and per ``kind``) and the loss on
the reference assistant tokens.

Why these figures: exact match is what a user of a task-specific fine-tune checks first, and it
needs no judge model; the token loss (and its perplexity) is defined for any data, including
free-form replies that exact match cannot credit. A generation is compared with the reference
turn as the base's template renders it -- text, tool-call markup and all -- up to the end of
turn, ignoring whitespace differences, so the comparison needs no knowledge of the template.

Rows are sharded over ranks (``rows[rank::world]``) and the counts summed with ``all_reduce``;
prompts are sorted by length and left-padded into batches so that little compute goes to padding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

from training.encode import IGNORE, EvalItem, normalise

__all__ = ["EVAL_BATCH", "evaluate", "generate_texts", "metrics_from_sums"]

EVAL_BATCH = 64
EXTRA_NEW_TOKENS = 4  # beyond the reference's length: enough to see whether the turn ends


def _all_reduce(values: list[float], device: torch.device) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor)
    return [float(v) for v in tensor.tolist()]


@torch.no_grad()
def generate_texts(model: Any, tokenizer: Any, items: Sequence[EvalItem], stop_ids: set[int]) -> list[str]:
    """Greedy continuations of ``items``' prompts, cut at the first stop token, in input order."""
    model.eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(stop_ids))
    order = sorted(range(len(items)), key=lambda i: len(items[i].prompt_ids))
    out: dict[int, str] = {}
    for start in range(0, len(order), EVAL_BATCH):
        chunk = order[start : start + EVAL_BATCH]
        prompts = [items[i].prompt_ids for i in chunk]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
        budget = max(items[i].reference_tokens for i in chunk) + EXTRA_NEW_TOKENS
        limit = getattr(model.config, "max_position_embeddings", width + budget)
        # transformers types ``generate`` through a decorator whose ``self`` mypy cannot bind
        generated = cast(Any, model).generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max(1, min(budget, limit - width)),
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=sorted(stop_ids),
        )
        for i, row in zip(chunk, generated[:, width:].tolist(), strict=True):
            cut = next((k for k, tok in enumerate(row) if tok in stop_ids), len(row))
            out[i] = tokenizer.decode(row[:cut], skip_special_tokens=False)
    return [out[i] for i in range(len(items))]


@torch.no_grad()
def _loss_sums(model: Any, items: Sequence[EvalItem], pad: int) -> tuple[float, int]:
    """Summed cross-entropy and count over the reference (labelled) tokens of ``items``."""
    total, count = 0.0, 0
    for start in range(0, len(items), EVAL_BATCH):
        chunk = items[start : start + EVAL_BATCH]
        width = max(len(it.encoded.input_ids) for it in chunk)
        ids = torch.tensor([it.encoded.input_ids + [pad] * (width - len(it.encoded.input_ids)) for it in chunk])
        labels = torch.tensor([it.encoded.labels + [IGNORE] * (width - len(it.encoded.labels)) for it in chunk])
        mask = torch.tensor(
            [[1] * len(it.encoded.input_ids) + [0] * (width - len(it.encoded.input_ids)) for it in chunk]
        )
        logits = model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device)).logits.float()
        shifted = labels[:, 1:].to(model.device)
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)), shifted.reshape(-1), ignore_index=IGNORE, reduction="sum"
        )
        total += float(loss.item())
        count += int((shifted != IGNORE).sum().item())
    return total, count


def metrics_from_sums(sums: dict[str, float]) -> dict[str, float]:
    """``exact_match``, ``exact_match/<kind>``, ``mean_token_loss`` and ``perplexity`` from the
    summed counters (``hits``, ``n``, ``hits/<kind>``, ``n/<kind>``, ``loss_sum``, ``tokens``)."""
    metrics = {"exact_match": sums["hits"] / max(1.0, sums["n"])}
    for key, n in sorted(sums.items()):
        if key.startswith("n/") and n:
            kind = key[2:]
            metrics[f"exact_match/{kind}"] = sums[f"hits/{kind}"] / n
    mean = sums["loss_sum"] / max(1.0, sums["tokens"])
    metrics["mean_token_loss"] = mean
    metrics["perplexity"] = math.exp(min(mean, 50.0))
    return metrics


def evaluate(
    model: Any,
    tokenizer: Any,
    items: Sequence[EvalItem],
    stop_ids: set[int],
    rank: int = 0,
    world: int = 1,
    device: torch.device | None = None,
) -> tuple[dict[str, float], int]:
    """Metrics over all ranks' shards of ``items``; every rank must call it. Returns (metrics, n)."""
    shard = list(items[rank::world])
    texts = generate_texts(model, tokenizer, shard, stop_ids) if shard else []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(stop_ids))
    loss_sum, tokens = _loss_sums(model, shard, pad) if shard else (0.0, 0)
    kinds = sorted({it.kind for it in items if it.kind is not None})
    hits = [normalise(t) == it.reference for t, it in zip(texts, shard, strict=True)]
    local = [float(sum(hits)), float(len(shard)), loss_sum, float(tokens)]
    for kind in kinds:
        local.append(float(sum(h for h, it in zip(hits, shard, strict=True) if it.kind == kind)))
        local.append(float(sum(it.kind == kind for it in shard)))
    total = _all_reduce(local, device or torch.device("cpu"))
    sums = {"hits": total[0], "n": total[1], "loss_sum": total[2], "tokens": total[3]}
    for j, kind in enumerate(kinds):
        sums[f"hits/{kind}"], sums[f"n/{kind}"] = total[4 + 2 * j], total[5 + 2 * j]
    return metrics_from_sums(sums), int(total[1])
