"""The per-worker training loop that Ray Train runs on every DDP rank.

Why it looks like this:

* The driver tokenizes the data once and puts it in Ray's object store; every rank reads the same
  encoded rows, so ranks agree on the data without each re-rendering thousands of templates.
* Batches are drawn uniformly from a generator seeded by ``(seed, step, rank)``, sorted by length
  and cut into micro-batches padded to their own longest row, so a run resumed from a checkpoint
  sees exactly the batches an uninterrupted run would have seen, every step mixes the data's
  kinds, and little compute goes to padding.
* Every ``checkpoint_every`` steps all ranks call ``ray.train.report`` and rank 0 attaches the
  model, optimizer and schedule state; on restart ``ray.train.get_checkpoint()`` hands it back and
  the loop continues from that step. Progress between checkpoints goes to the driver's progress
  board (:mod:`training.progress`), not through ``report``.
* After the last step all ranks score a shard of the evaluation rows (:mod:`training.evaluate`)
  and rank 0 reports a final checkpoint with the Hugging Face folder (``hf/``) and ``result.json``;
  the folder holds the new weights and the base's own tokenizer files, copied byte for byte.
* A loss that is no longer a finite number stops the run (on every rank: the value is the mean
  across ranks) before it is checkpointed: the weights are lost to ``nan`` and a checkpoint of them
  would only resume the divergence.
* With ``extra["lora"]`` the base is wrapped in peft adapters (:mod:`training.lora`): only they
  train, checkpoints hold only their weights, and ``hf/`` is the adapter folder vLLM loads.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

from training import lora
from training.encode import IGNORE
from training.evaluate import evaluate

__all__ = ["HF_DIR", "RESULT_FILE", "RunSpec", "check_finite", "copy_tokenizer_files", "train_loop_per_worker"]

STATE_FILE = "state.pt"
RESULT_FILE = "result.json"
HF_DIR = "hf"
RECENT = 50
MICRO = 4  # length-sorted micro-batches per step (less padding, same gradient)
# Files of a base folder that are not carried to the trained version: weights and the configs
# ``save_pretrained`` rewrites, plus the store's own manifest.
_NOT_COPIED = ("config.json", "generation_config.json", "manifest.json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")

logger = logging.getLogger("training")


@dataclass(frozen=True)
class RunSpec:
    """Everything a worker needs; it crosses to the workers as a plain dict."""

    label: str
    base_dir: str
    steps: int
    seed: int
    batch_size: int
    lr: float
    warmup: float
    weight_decay: float
    checkpoint_every: int
    train_rows: Any  # ObjectRef of list[tuple[list[int], list[int]]]
    eval_items: Any  # ObjectRef of list[EvalItem]
    stop_ids: list[int]
    pad_id: int
    board: Any = None  # ProgressBoard actor handle
    post_every: int = 10
    threads: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def copy_tokenizer_files(base_dir: str | Path, out: str | Path) -> list[str]:
    """Copy the base folder's top-level non-weight files (tokenizer, template, licence...)."""
    copied = []
    for path in sorted(Path(base_dir).iterdir()):
        if not path.is_file() or path.name in _NOT_COPIED or path.name.startswith("."):
            continue
        if path.name.endswith(_WEIGHT_SUFFIXES) or path.name.endswith(".index.json"):
            continue
        shutil.copy2(path, Path(out) / path.name)
        copied.append(path.name)
    return copied


def _batch(rows: list[tuple[list[int], list[int]]], size: int, spec: RunSpec, step: int, rank: int, pad: int):  # type: ignore[no-untyped-def]
    """Seeded rows of one step as length-sorted micro-batches, each right-padded to its longest row.

    ``size`` rows are drawn uniformly (so every step mixes the kinds of the data), sorted by
    length and cut into up to ``MICRO`` contiguous micro-batches: the step's gradient is the
    uniform batch's (see :func:`_step`), while little compute goes to padding.
    """
    rng = np.random.default_rng([spec.seed, step, rank])
    picked = sorted((rows[i] for i in rng.integers(0, len(rows), size=size).tolist()), key=lambda r: len(r[0]))
    chunk = -(-size // MICRO)
    out = []
    for start in range(0, size, chunk):
        part = picked[start : start + chunk]
        width = max(len(ids) for ids, _ in part)
        ids = torch.full((len(part), width), pad, dtype=torch.long)
        labels = torch.full((len(part), width), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(part), width), dtype=torch.long)
        for i, (row_ids, row_labels) in enumerate(part):
            ids[i, : len(row_ids)] = torch.tensor(row_ids)
            labels[i, : len(row_labels)] = torch.tensor(row_labels)
            mask[i, : len(row_ids)] = 1
        out.append((ids, labels, mask))
    return out


def _step(ddp: Any, micro: list[tuple[Any, Any, Any]]) -> float:
    """Forward/backward over the micro-batches; returns the mean token loss of the whole batch.

    Each micro-batch's mean loss is weighted by its share of the batch's target tokens, so the
    accumulated gradient equals that of one padded batch; DDP all-reduces on the last backward.
    """
    counts = [int((labels[:, 1:] != IGNORE).sum()) for _, labels, _ in micro]
    total = max(1, sum(counts))
    used = [i for i, n in enumerate(counts) if n] or [len(micro) - 1]
    value = 0.0
    for i in used:
        (ids, labels, mask), n = micro[i], counts[i]
        sync = i == used[-1]
        with contextlib.nullcontext() if sync or not hasattr(ddp, "no_sync") else ddp.no_sync():
            loss = ddp(input_ids=ids, attention_mask=mask, labels=labels).loss * (n / total)
            loss.backward()
        value += float(loss.item())
    return value


def _weights(spec: RunSpec, model: Any) -> dict[str, Any]:
    """What a checkpoint keeps of the model: every weight, or an adapter's only."""
    return lora.adapter_state(model) if "lora" in spec.extra else dict(model.state_dict())


def _restore(spec: RunSpec, model: Any, optimizer: Any, scheduler: Any) -> dict[str, Any]:
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return {"step": 0, "loss": float("nan")}
    with checkpoint.as_directory() as directory:
        state = torch.load(Path(directory) / STATE_FILE, map_location="cpu", weights_only=False)
    if "lora" in spec.extra:
        lora.load_adapter_state(model, state["model"])
    else:
        model.load_state_dict(state["model"])
    if "optimizer" in state:  # absent from the final checkpoint, where no step remains
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    return {"step": int(state["step"]), "loss": float(state["loss"])}


def _report(metrics: dict[str, Any], rank: int, step: int, state: dict[str, Any] | None, extra: Any = None) -> None:
    """Report from every rank (Ray Train expects it); rank 0 attaches a checkpoint."""
    if state is None or rank != 0:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory(prefix="ckpt-") as directory:
        torch.save(state, Path(directory) / STATE_FILE)
        if extra is not None:
            extra(Path(directory))
        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(directory),
            checkpoint_dir_name=f"checkpoint_{step:06d}",
        )


def _mean_across_ranks(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor)
        tensor /= dist.get_world_size()
    return float(tensor.item())


def check_finite(label: str, step: int, loss: float) -> float:
    """``loss``, unless it is not a finite number: then the run has diverged and stops here."""
    if not math.isfinite(loss):
        raise FloatingPointError(
            f"[{label}] the training loss is {loss} at step {step}: the run diverged (a lower --lr may help)"
        )
    return loss


def _setup(spec: RunSpec, world: int) -> tuple[Any, Any, Any]:
    model = AutoModelForCausalLM.from_pretrained(spec.base_dir, dtype=torch.float32)
    if "lora" in spec.extra:
        model = lora.wrap(model, spec.extra["lora"])
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in trained if p.ndim >= 2]
    no_decay = [p for n, p in trained if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=spec.lr)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer,
        max_lr=spec.lr,
        total_steps=spec.steps,
        pct_start=warmup_fraction(spec.warmup, spec.steps),
        anneal_strategy="cos",
    )
    return model, optimizer, scheduler


def warmup_fraction(warmup: float, steps: int) -> float:
    """The share of steps spent warming up, with at least 1.5 of them: OneCycleLR divides by the
    warm-up's length in steps minus one, so a short run (``--steps 10`` at 10%) would crash."""
    return min(max(warmup, 1.5 / steps), 0.75)


def quiet_worker_logs() -> None:
    """Drop Ray Train's per-report INFO line and transformers' progress bars on this worker.

    Ray Train's context module names its logger after its *file path*, so the ``ray.train`` log
    level (``RunConfig.logging_config``) does not reach it and every ``report()`` is printed;
    raising that one logger to WARNING keeps its warnings and errors.
    """
    from ray.train.v2._internal.execution import context
    from transformers.utils import logging as hf_logging

    logging.getLogger(context.__file__).setLevel(logging.WARNING)
    hf_logging.disable_progress_bar()


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train entry point (one call per rank)."""
    quiet_worker_logs()
    spec = RunSpec(**config)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(spec.threads or max(1, (os.cpu_count() or 1) // ctx.get_local_world_size()))
    rows: list[tuple[list[int], list[int]]] = ray.get(spec.train_rows)
    model, optimizer, scheduler = _setup(spec, world)
    restored = _restore(spec, model, optimizer, scheduler)
    start = restored["step"]
    ddp = ray.train.torch.prepare_model(model)
    per_rank = max(1, spec.batch_size // world)
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        what = f"resuming at step {start}" if start else "starting"
        logger.info(
            f"[{spec.label}] {what}: {n_params:,} trained parameters, {world} worker(s) x {per_rank} rows "
            f"x {torch.get_num_threads()} thread(s), {len(rows)} rows, {spec.steps} steps"
        )
    # the reported loss is the mean of the last RECENT steps: the run's current level, not its history
    window: deque[float] = deque(maxlen=RECENT)
    loss_value, t0 = restored["loss"], time.monotonic()
    for step in range(start + 1, spec.steps + 1):
        ddp.train()
        optimizer.zero_grad(set_to_none=True)
        loss = _step(ddp, _batch(rows, per_rank, spec, step, rank, spec.pad_id))
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        window.append(loss)
        if rank == 0 and spec.board is not None and (step % spec.post_every == 0 or step == spec.steps):
            eta = (time.monotonic() - t0) / (step - start) * (spec.steps - step)
            last = list(window)[-spec.post_every :]
            post = {"step": step, "loss": sum(last) / len(last)}
            spec.board.post.remote(post | {"lr": scheduler.get_last_lr()[0], "eta_s": eta})
        if step % spec.checkpoint_every == 0 and step < spec.steps:
            loss_value = check_finite(spec.label, step, _mean_across_ranks(sum(window) / len(window)))
            state = {"step": step, "loss": loss_value, "model": _weights(spec, model)}
            state |= {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
            _report({"step": step, "loss": loss_value}, rank, step, state)
    if window:
        loss_value = check_finite(spec.label, spec.steps, _mean_across_ranks(sum(window) / len(window)))
    _finish(spec, model, rank, world, start, loss_value, time.monotonic() - t0)


def _finish(spec: RunSpec, model: Any, rank: int, world: int, start: int, final_loss: float, train_s: float) -> None:
    """Score the evaluation rows (sharded over ranks); rank 0 reports the final HF checkpoint."""
    t0 = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(spec.base_dir)
    items = ray.get(spec.eval_items)
    metrics, n = evaluate(model, tokenizer, items, set(spec.stop_ids), rank, world)
    eval_s = time.monotonic() - t0
    if rank == 0:
        logger.info(
            f"[{spec.label}] eval on {n} rows: "
            + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if "/" not in k)
            + f" (train {train_s:.0f}s, eval {eval_s:.1f}s)"
        )
    result: dict[str, Any] = {"steps": spec.steps, "final_loss": final_loss, "resumed_from_step": start}
    result |= {"train_s": round(train_s, 1), "eval_s": round(eval_s, 1), "metrics": metrics, "n": n}

    def write_hf(directory: Path) -> None:
        hf = directory / HF_DIR
        if "lora" in spec.extra:  # the adapter folder vLLM loads; the base keeps the tokenizer
            lora.save_adapter(model.cpu(), hf, spec.extra["base_ref"])
        else:
            model.cpu().save_pretrained(hf)
            copy_tokenizer_files(spec.base_dir, hf)
        (directory / RESULT_FILE).write_text(json.dumps(result))

    state = {"step": spec.steps, "loss": final_loss, "model": _weights(spec, model)}
    _report({"step": spec.steps, "loss": final_loss, "done": True}, rank, spec.steps, state, write_hf)
