"""The per-worker training loop that Ray Train runs on every DDP rank.

Why it looks like this:

* Batches are drawn from a generator seeded by ``(seed, step, rank)``, so a run resumed from a
  checkpoint sees exactly the batches an uninterrupted run would have seen.
* Every ``checkpoint_every`` steps rank 0 reports a Ray Train checkpoint with the model, optimizer
  and LR-schedule state; on restart ``ray.train.get_checkpoint()`` hands it back and the loop
  continues from that step instead of step 0.
* After the last step all ranks score a shard of the held-out set with greedy decoding, and rank 0
  reports a final checkpoint holding the Hugging Face model directory (``hf/``) and ``result.json``;
  the driver publishes that directory to the checkpoint store.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from transformers import LlamaForCausalLM

from training.data import exact_match, make_split
from training.model import build_model, encode_examples, greedy_answers
from training.tokenizer import save_tokenizer

__all__ = ["RunSpec", "train_loop_per_worker"]

STATE_FILE = "state.pt"
RESULT_FILE = "result.json"
HF_DIR = "hf"

# Ray Train routes worker logging to the driver's terminal and to its per-worker log files
# (``ray-train-app-worker-*.log``); a plain print() would show up twice on the terminal.
logger = logging.getLogger("training")


@dataclass(frozen=True)
class RunSpec:
    """Everything a worker needs; it crosses to the workers as a plain dict."""

    label: str
    task: str
    size: str
    steps: int
    seed: int
    batch_size: int
    peak_lr: float
    checkpoint_every: int
    log_every: int
    parent_dir: str | None = None


def _log(rank: int, message: str) -> None:
    if rank == 0:
        logger.info(message)


def _mean_across_ranks(value: float, device: torch.device) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor)
        tensor /= dist.get_world_size()
    return float(tensor.item())


def _sum_across_ranks(value: int, device: torch.device) -> int:
    tensor = torch.tensor([value], dtype=torch.long, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor)
    return int(tensor.item())


def _batch(n_rows: int, size: int, seed: int, step: int, rank: int) -> torch.Tensor:
    rng = np.random.default_rng([seed, step, rank])
    return torch.from_numpy(rng.integers(0, n_rows, size=size))


def _restore(model: LlamaForCausalLM, optimizer: Any, scheduler: Any) -> dict[str, Any]:
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return {"step": 0, "loss": float("nan")}
    with checkpoint.as_directory() as directory:
        state = torch.load(Path(directory) / STATE_FILE, map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    if "optimizer" in state:  # absent from the final checkpoint, where no step remains
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    return {"step": int(state["step"]), "loss": float(state["loss"])}


def _report(metrics: dict[str, Any], rank: int, step: int, state: dict[str, Any] | None, extra: Any = None) -> None:
    """Report metrics from every rank; rank 0 attaches a checkpoint when ``state`` is given."""
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


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train entry point (one call per rank)."""
    spec = RunSpec(**config)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ctx.get_local_world_size()))

    split = make_split(spec.task, spec.seed)
    inputs, labels = (t.to(device) for t in encode_examples(split.train))
    model = (
        LlamaForCausalLM.from_pretrained(spec.parent_dir, dtype=torch.float32)
        if spec.parent_dir
        else build_model(spec.size, spec.seed)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.peak_lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=spec.peak_lr, total_steps=spec.steps)
    restored = _restore(model, optimizer, scheduler)
    start = restored["step"]
    ddp = ray.train.torch.prepare_model(model)
    per_rank = max(1, spec.batch_size // world)
    if start:
        _log(rank, f"[{spec.label}] resuming from step {start}/{spec.steps} (Ray Train checkpoint)")
    else:
        n_params = sum(p.numel() for p in model.parameters())
        _log(
            rank,
            f"[{spec.label}] starting: {n_params:,} parameters, {world} worker(s) x {per_rank} "
            f"rows per step, {spec.steps} steps, device {device}",
        )

    loss_value, window, t0 = restored["loss"], [], time.monotonic()
    for step in range(start + 1, spec.steps + 1):
        ddp.train()
        idx = _batch(len(inputs), per_rank, spec.seed, step, rank).to(device)
        loss = ddp(input_ids=inputs[idx], labels=labels[idx]).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        window.append(loss.item())

        checkpoint_now = step % spec.checkpoint_every == 0 and step < spec.steps
        if not (step % spec.log_every == 0 or checkpoint_now or step == spec.steps):
            continue
        loss_value = _mean_across_ranks(sum(window) / len(window), device)
        window = []
        elapsed = time.monotonic() - t0
        eta = elapsed / (step - start) * (spec.steps - step)
        lr = scheduler.get_last_lr()[0]
        _log(
            rank,
            f"[{spec.label}] step {step}/{spec.steps} loss {loss_value:.4f} lr {lr:.2e} "
            f"elapsed {elapsed:.0f}s eta {eta:.0f}s" + (" (checkpoint)" if checkpoint_now else ""),
        )
        metrics = {"step": step, "loss": loss_value, "lr": lr, "elapsed_s": elapsed}
        metrics |= {"eta_s": eta, "resumed_from_step": start}
        state = None
        if checkpoint_now:
            state = {"step": step, "loss": loss_value, "model": model.state_dict()}
            state |= {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
        _report(metrics, rank, step, state)

    _finish(spec, model, rank, world, device, start, loss_value, time.monotonic() - t0)


def _finish(
    spec: RunSpec,
    model: LlamaForCausalLM,
    rank: int,
    world: int,
    device: torch.device,
    start: int,
    final_loss: float,
    train_s: float,
) -> None:
    """Score the held-out set (sharded over ranks); rank 0 reports the final HF checkpoint."""
    t0 = time.monotonic()
    held_out = make_split(spec.task, spec.seed).eval
    shard = held_out[rank::world]
    hits = round(exact_match(lambda prompts: greedy_answers(model, prompts), shard) * len(shard))
    score = _sum_across_ranks(hits, device) / len(held_out)
    eval_s = time.monotonic() - t0
    _log(
        rank,
        f"[{spec.label}] held-out exact match {score:.4f} on {len(held_out)} prompts "
        f"(train {train_s:.0f}s, eval {eval_s:.1f}s)",
    )
    result = {
        "steps": spec.steps,
        "final_loss": final_loss,
        "resumed_from_step": start,
        "train_s": round(train_s, 1),
        "eval": {"exact_match": score, "n": len(held_out)},
    }

    def write_hf(directory: Path) -> None:
        hf = directory / HF_DIR
        model.cpu().save_pretrained(hf)
        save_tokenizer(hf)
        (directory / RESULT_FILE).write_text(json.dumps(result))

    state = {"step": spec.steps, "loss": final_loss, "model": model.state_dict()}
    metrics = {"step": spec.steps, "loss": final_loss, "exact_match": score, "done": True}
    _report(metrics, rank, spec.steps, state, write_hf)
