"""What the training job accepts: its arguments (:func:`parser`, the same for ``python -m
training.train`` and the RayJob's entrypoint), the checks that refuse bad ones before anything is
claimed (:func:`check_args`), and the hyperparameters a base gets when none are given
(:func:`default_hyperparameters`).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from typing import Any

from serving.registry import check_name
from training.bases import ResolvedBase, parameter_count
from training.lora import LoraOptions

__all__ = [
    "DEFAULT_CHECKPOINT_EVERY",
    "DEFAULT_WORKERS",
    "METHODS",
    "TrainingError",
    "check_args",
    "default_hyperparameters",
    "hyperparameters",
    "parser",
]

DEFAULT_CHECKPOINT_EVERY = 200
METHODS = ("full", "lora")
DEFAULT_WORKERS = 2


class TrainingError(RuntimeError):
    """The job cannot start or finish (bad arguments, a run directory from other arguments...)."""


def default_hyperparameters(base: ResolvedBase, rows: int, lora: bool = False) -> dict[str, Any]:
    """Defaults that train the project's tiny bases from scratch and stay sane for a real base.

    From scratch (``init:``) a high one-cycle peak learns a small model fast; a pretrained base
    takes a smaller step so a fine-tune does not wipe what it knows (3e-3 below ~10M parameters,
    1e-4 below ~100M, 2e-5 above), with about three passes over the data, within bounds. A LoRA
    adapter starts at zero and cannot wipe the base, so it takes the usual larger adapter step
    (3e-3 on a tiny base, 2e-4 on a real one). A base whose size its files do not tell
    (:func:`training.bases.parameter_count`) gets the largest base's defaults.
    """
    if base.is_init:
        return {"steps": 1500, "batch_size": 128, "lr": 3e-3, "warmup": 0.1, "weight_decay": 0.01}
    count = parameter_count(base.directory)
    params = math.inf if count is None else count
    # a few-million-parameter base (the project's own) needs a large step to learn a new task in a
    # few hundred steps; real pretrained bases get the usual small ones
    lr = 3e-3 if params < 10_000_000 else 1e-4 if params < 100_000_000 else 2e-5
    if lora:
        lr = 3e-3 if params < 10_000_000 else 2e-4
    batch = 128 if params < 10_000_000 else 16  # a tiny base's step costs little; more rows a step
    steps = min(2000, max(20, math.ceil(3 * rows / batch)))
    return {"steps": steps, "batch_size": batch, "lr": lr, "warmup": 0.05, "weight_decay": 0.0}


def check_args(model: str, version: str, method: str, opts: Mapping[str, Any]) -> None:
    """Refuse arguments the workers would fail on (or silently bend), before anything is claimed."""
    check_name("model", model)
    check_name("version", version)
    if method not in METHODS:
        raise TrainingError(f"unknown method {method!r}; expected one of {', '.join(METHODS)}")
    for key in ("workers", "steps", "checkpoint_every", "batch_size", "threads"):
        if opts[key] is not None and opts[key] < 1:
            raise TrainingError(f"--{key.replace('_', '-')} must be >= 1, got {opts[key]}")
    lr = opts["lr"]
    if lr is not None and not (math.isfinite(lr) and lr > 0):
        raise TrainingError(f"--lr must be a finite number > 0, got {lr}")
    batch, workers = opts["batch_size"], opts["workers"]
    if batch is not None and batch % workers:
        lower, upper = batch // workers * workers, (batch // workers + 1) * workers
        choices = f"{lower} or {upper}" if lower else f"{upper}"
        raise TrainingError(
            f"--batch-size {batch} is not a multiple of --workers {workers}: each rank trains the same "
            f"number of rows a step, so the batch must split evenly; pass --batch-size {choices}"
        )


def hyperparameters(base: ResolvedBase, rows: int, opts: Mapping[str, Any]) -> dict[str, Any]:
    """The defaults for ``base``, overridden by the ones given. A default batch is rounded down to a
    multiple of the ranks (each trains an equal share), so the manifest records what is trained."""
    hyper = default_hyperparameters(base, rows, lora=opts["lora"] is not None)
    hyper |= {k: opts[k] for k in ("steps", "batch_size", "lr") if opts[k] is not None}
    workers = opts["workers"]
    if opts["batch_size"] is None:  # a given one is a multiple already (check_args)
        if hyper["batch_size"] < workers:
            raise TrainingError(
                f"the default batch size {hyper['batch_size']} is smaller than --workers {workers}: "
                f"pass --batch-size {workers} or another multiple of it"
            )
        hyper["batch_size"] -= hyper["batch_size"] % workers
    return hyper


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m training.train",
        fromfile_prefix_chars="@",  # @FILE: more arguments, one a line (serving up passes URIs so)
        description="Fine-tune a causal LM on JSONL data (Ray Train, DDP) and publish "
        "<root>/<model>/<version>/ with a manifest.",
    )
    p.add_argument("--model", required=True, help="model name (a directory under --root)")
    p.add_argument("--version", required=True, help="new, immutable version name")
    p.add_argument("--base", required=True, help="init:<family>-<size>, model@version, folder, URI or hub id")
    p.add_argument("--data", required=True, help="training JSONL (path or URI) or builtin:<task>")
    p.add_argument("--eval", default=None, help="eval JSONL; default: builtin eval, or a seeded 5%% holdout")
    p.add_argument("--method", default="full", choices=METHODS, help="full weights, or a LoRA adapter (peft)")
    p.add_argument("--root", required=True, help="checkpoint store: local path or fsspec URI")
    p.add_argument("--steps", type=int, default=None, help="default: depends on the base and the data")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--lr", type=float, default=None, help="peak learning rate")
    p.add_argument("--workers", type=int, default=DEFAULT_WORKERS, help="DDP ranks (Ray Train workers)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cores/ranks)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=DEFAULT_CHECKPOINT_EVERY)
    p.add_argument("--keep-run", action="store_true", help="keep Ray Train state after publishing")
    lora = p.add_argument_group("LoRA (--method lora)")
    lora.add_argument("--lora-rank", type=int, default=LoraOptions.rank, help="adapter rank r")
    lora.add_argument("--lora-alpha", type=int, default=LoraOptions.alpha, help="scaling alpha")
    lora.add_argument(
        "--lora-targets",
        default=",".join(LoraOptions.target_modules),
        help="comma-separated module names to adapt (the attention and MLP projections by default)",
    )
    return p
