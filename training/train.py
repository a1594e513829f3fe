"""Fine-tune any Hugging Face causal LM on JSONL data with Ray Train; publish a versioned checkpoint.

Usage::

    python -m training.train --model support-bot --version v2 --base <ref> --data train.jsonl \\
        [--eval eval.jsonl] --method full --root ./checkpoints [--steps N] [--workers N]

``--base`` is ``init:<family>-<size>``, ``model@version`` of the store, a local folder, an fsspec
URI or a hub id (:mod:`training.bases`); ``--data``/``--eval`` are JSONL files or URIs in OpenAI's
fine-tuning formats, or ``builtin:<task>`` (:mod:`training.jsonl`). The driver (this module)
checks the arguments and that the version is new, resolves and tokenizes everything once, runs
``TorchTrainer`` (DDP over ``--workers`` ranks, GPUs when the cluster has enough), then publishes
the final folder through :class:`serving.registry.CheckpointStore` (temp dir, manifest last,
rename), unless its loss or an eval metric is not a finite number. Ray Train keeps resumable
state under ``<root>/<model>/.runs/<version>``: the same command after a crash continues from the
last checkpoint; the state is removed once the version is published. A worker's failure ends the
job with that exception on one line, like every other error.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from serving.registry import CheckpointStore, RegistryError, architecture_of
from training.arguments import (
    DEFAULT_CHECKPOINT_EVERY,
    DEFAULT_WORKERS,
    TrainingError,
    check_args,
    hyperparameters,
    parser,
)
from training.bases import BaseError, ResolvedBase, is_store_ref, resolve_base
from training.encode import EncodeError
from training.jsonl import DataError, Dataset, resolve_data
from training.lora import LoraOptions, check_targets
from training.ray_runtime import PrivateRayRefused, init_ray, run_trainer
from training.run_dir import RunConflict, claim_run_dir, what_is_left
from training.run_lock import RunLocked, run_lock

__all__ = ["TrainingError", "failure_message", "main", "train"]

CACHE_DIR = Path(os.environ.get("RAYSTACK_CACHE", Path.home() / ".cache" / "raystack"))


def code_revision() -> str:
    """``git rev-parse HEAD`` of the checkout this module lives in, or ``"unknown"``."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def _encode(base: ResolvedBase, train_set: Dataset, eval_set: Dataset) -> dict[str, Any]:
    """Tokenize both sets on the driver with the base's tokenizer and chat template."""
    from transformers import AutoConfig, AutoTokenizer

    from training.encode import Encoder, stop_ids

    tokenizer = AutoTokenizer.from_pretrained(base.directory)
    positions = int(getattr(AutoConfig.from_pretrained(base.directory), "max_position_embeddings", 0) or 0)
    limit = tokenizer.model_max_length if tokenizer.model_max_length < 1_000_000 else positions
    max_length = min(x for x in (positions, limit) if x) if (positions or limit) else 2048
    stops = stop_ids(base.directory, tokenizer)
    encoder = Encoder(tokenizer, max_length, stops)
    rows = [(e.input_ids, e.labels) for e in encoder.encode_all(train_set.rows, train_set.ref.uri)]
    items = encoder.eval_items(eval_set.rows, eval_set.ref.uri)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    return {"rows": rows, "items": items, "stop_ids": stops, "pad_id": pad, "max_length": max_length}


def _corpus(train_set: Dataset) -> list[dict[str, Any]]:
    """Training rows in the shape :func:`training.families.build_base` learns a tokenizer from."""
    return [
        {"messages": r.messages, "tools": r.tools}
        if r.format == "chat"
        else {"prompt": r.prompt, "completion": r.completion}
        for r in train_set.rows
    ]


def _check_finite(label: str, outcome: Mapping[str, Any], run_uri: str) -> None:
    """Refuse to publish a run that diverged: its loss or an eval metric is not a finite number."""
    values = {"final training loss": outcome["final_loss"]}
    values |= {f"eval {k}": v for k, v in outcome["metrics"].items()}
    bad = [f"{name} {value}" for name, value in values.items() if not math.isfinite(value)]
    if bad:
        raise TrainingError(
            f"{label} is not published: {', '.join(bad)} (not a finite number: the run diverged; "
            f"a lower --lr may help); its run directory {run_uri} is kept for inspection: delete it "
            f"before training {label} again"
        )


def train(
    model: str,
    version: str,
    root: str,
    base: str,
    data: str,
    eval_data: str | None = None,
    method: str = "full",
    steps: int | None = None,
    seed: int = 0,
    *,
    batch_size: int | None = None,
    lr: float | None = None,
    workers: int = DEFAULT_WORKERS,
    threads: int | None = None,
    checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY,
    use_gpu: bool | None = None,
    ray_address: str | None = None,
    keep_run: bool = False,
    lora: LoraOptions | None = None,
) -> dict[str, Any]:
    """Train ``model@version`` from ``base`` on ``data``, evaluate on ``eval_data``, publish under
    ``root`` and return the published manifest as a dict.

    Unset hyperparameters come from :func:`default_hyperparameters`. Ray is started locally unless
    it is already initialised, ``ray_address`` is given or ``RAY_ADDRESS`` is set. With
    ``method="lora"`` the version is a peft adapter of ``base`` (which must be a store version,
    ``model@version``, so the adapter names the exact weights it applies to), shaped by ``lora``.
    """
    opts: dict[str, Any] = {
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "workers": workers,
        "threads": threads,
        "checkpoint_every": checkpoint_every,
    }
    check_args(model, version, method, opts)
    if method == "lora" and not is_store_ref(base):
        raise TrainingError(
            f"--method lora needs a base from the checkpoint store (model@version), not {base!r}: "
            "an adapter records the exact base version it applies to, and only a store version has one"
        )
    store = CheckpointStore(root)
    _refuse_existing(store, model, version)
    opts |= {"use_gpu": use_gpu, "ray_address": ray_address, "keep_run": keep_run}
    opts |= {"lora": (lora or LoraOptions()) if method == "lora" else None}
    try:
        with run_lock(store, model, version):
            _refuse_existing(store, model, version)  # published by the job that held the lock
            workdir = Path(tempfile.mkdtemp(prefix="train-"))
            try:
                return _train(store, model, version, base, data, eval_data, method, seed, workdir, opts)
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
    except (RunLocked, RunConflict, PrivateRayRefused) as exc:
        raise TrainingError(str(exc)) from None
    finally:  # the folders the lock made, where they hold nothing else
        runs = store.run_path(model, version).rsplit("/", 1)[0]
        for folder in (runs, runs.rsplit("/", 1)[0]):
            with contextlib.suppress(OSError):
                if store.fs.isdir(folder) and not store.fs.ls(folder):
                    store.fs.rmdir(folder)


def _refuse_existing(store: CheckpointStore, model: str, version: str) -> None:
    if store.exists(model, version):
        raise TrainingError(
            f"{model}@{version} already exists at {store.uri(model, version)}; "
            "versions are immutable, pick a new version name"
        )


def _train(
    store: CheckpointStore,
    model: str,
    version: str,
    base_ref: str,
    data: str,
    eval_data: str | None,
    method: str,
    seed: int,
    workdir: Path,
    opts: dict[str, Any],
) -> dict[str, Any]:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    t0 = time.monotonic()
    train_set, eval_set, eval_how = resolve_data(data, eval_data, CACHE_DIR / "data", seed)
    base = resolve_base(
        base_ref, store, workdir, CACHE_DIR / "bases", lambda: _corpus(train_set), train_set.ref.sha256, seed
    )
    lora: LoraOptions | None = opts["lora"]
    if lora is not None:
        check_targets(base.directory, lora)
    encoded = _encode(base, train_set, eval_set)
    hyper = hyperparameters(base, len(encoded["rows"]), opts)
    job = {"model": model, "version": version, "base": base.ref.model_dump(), "method": method, "seed": seed}
    job |= {"workers": opts["workers"], "data": train_set.ref.sha256, "eval": eval_set.ref.sha256, **hyper}
    if lora is not None:
        job["lora"] = lora.as_dict()
    run = claim_run_dir(store, model, version, job)
    prep_s = time.monotonic() - t0
    outcome, workers = _fit(store, run, f"{model}@{version}", base, encoded, hyper, seed, opts)
    try:
        _check_finite(f"{model}@{version}", outcome, store.fs.unstrip_protocol(run))
    except TrainingError:
        shutil.rmtree(Path(outcome["hf"]).parent, ignore_errors=True)  # the local copy of hf/
        raise
    fields = {
        "model": model,
        "version": version,
        "base": base.ref,
        "training": {
            "method": method,
            "steps": outcome["steps"],
            "final_loss": outcome["final_loss"],
            "seed": seed,
            "workers": workers,
            "resumed_from_step": outcome["resumed_from_step"],
            "wall_s": round(time.monotonic() - t0, 1),
            "data": train_set.ref,
            "hyperparameters": hyper
            | {"schedule": "one-cycle (cosine)", "max_length": encoded["max_length"], "rows_used": len(encoded["rows"])}
            | {"eval_split": eval_how, "prepare_s": round(prep_s, 1), "train_s": outcome["train_s"]},
        },
        "eval": {"metrics": outcome["metrics"], "n": outcome["n"], "data": eval_set.ref},
        "code_revision": code_revision(),
    }
    if lora is not None:
        fields["adapter"] = lora.as_dict()
        fields["architecture"] = architecture_of(base.directory)
    manifest = store.publish(Path(outcome["hf"]), fields)
    shutil.rmtree(Path(outcome["hf"]).parent, ignore_errors=True)  # the publish- folder it was copied into
    if not opts["keep_run"]:
        store.fs.rm(run, recursive=True)  # .runs/ itself goes once the lock is released (train)
    return manifest.model_dump(mode="json")


def _fit(
    store: CheckpointStore,
    run: str,
    label: str,
    base: ResolvedBase,
    encoded: dict[str, Any],
    hyper: dict[str, Any],
    seed: int,
    opts: dict[str, Any],
) -> tuple[dict[str, Any], int]:
    """Run the trainer; returns the final ``result.json`` (plus a local copy of ``hf/``)."""
    workers = int(opts["workers"])
    stop_ray = init_ray(workers, opts["ray_address"])  # first: before this process imports Ray
    import ray
    from ray.train.v2.api.exceptions import TrainingFailedError

    from training.loop import HF_DIR, RESULT_FILE
    from training.progress import ProgressPrinter

    try:
        printer = ProgressPrinter(label, int(hyper["steps"])).start()
        config = {"label": label, "base_dir": base.directory, "seed": seed, "board": printer.board}
        config |= {k: hyper[k] for k in ("steps", "batch_size", "lr", "warmup", "weight_decay")}
        config |= {"checkpoint_every": opts["checkpoint_every"], "threads": opts["threads"]}
        config |= {"train_rows": ray.put(encoded["rows"]), "eval_items": ray.put(encoded["items"])}
        config |= {"stop_ids": encoded["stop_ids"], "pad_id": encoded["pad_id"]}
        if opts["lora"] is not None:
            config["extra"] = {"lora": opts["lora"].as_dict(), "base_ref": base.ref.ref}
        try:
            private = stop_ray is not None and opts["ray_address"] is None and not os.environ.get("RAY_ADDRESS")
            result = run_trainer(store, run, config, workers, opts["use_gpu"], private)
        except TrainingFailedError as exc:
            raise TrainingError(f"{failure_message(label, exc)}; {what_is_left(store, run)}") from None
        finally:
            printer.stop()
        if result.checkpoint is None:
            raise TrainingError(f"{label}: the run reported no checkpoint")
        with result.checkpoint.as_directory() as directory:
            outcome = json.loads((Path(directory) / RESULT_FILE).read_text())
            hf = Path(tempfile.mkdtemp(prefix="publish-")) / HF_DIR
            shutil.copytree(Path(directory) / HF_DIR, hf)
        outcome["hf"] = str(hf)
    finally:
        if stop_ray is not None:
            stop_ray()
    return outcome, workers


def failure_message(label: str, exc: BaseException) -> str:
    """One line for a failed Ray Train run: the exception of the lowest failing rank (or of Ray
    Train's controller), without Ray's report and tracebacks around it."""
    failures: Mapping[int, BaseException] = getattr(exc, "worker_failures", None) or {}
    if failures:
        rank = min(failures)
        cause, where = failures[rank], f"rank {rank}"
    else:
        cause, where = getattr(exc, "controller_failure", None) or exc, "the Ray Train controller"
    text = " ".join(str(cause).split())
    return f"{label}: training failed on {where}: {type(cause).__name__}: {text}"


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    opts = {k: getattr(args, k) for k in ("steps", "batch_size", "lr", "workers", "threads", "seed")}
    try:
        manifest = train(
            args.model,
            args.version,
            args.root,
            args.base,
            args.data,
            args.eval,
            method=args.method,
            checkpoint_every=args.checkpoint_every,
            keep_run=args.keep_run,
            lora=LoraOptions.from_args(args.lora_rank, args.lora_alpha, args.lora_targets),
            **opts,
        )
    except (TrainingError, RegistryError, BaseError, DataError, EncodeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    path = CheckpointStore(args.root).uri(args.model, args.version)
    print(f"published {args.model}@{args.version} to {path}")
    print(json.dumps({k: v for k, v in manifest.items() if k not in ("files", "sizes")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
