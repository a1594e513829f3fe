"""Train a small Llama on an arithmetic task with Ray Train; publish it as a versioned checkpoint.

Usage::

    python -m training.train --model adder --version v1 --task add --root ./checkpoints

The driver (this module) checks that the version is new, runs ``TorchTrainer`` (DDP over
``--workers`` ranks, GPUs when the cluster has enough of them), then publishes the final Hugging
Face directory through :class:`serving.registry.CheckpointStore` (temp dir, manifest last, rename).
Ray Train keeps resumable state under ``<root>/<model>/.runs/<version>``; running the same command
again after a crash continues from the last checkpoint, and the state is removed once the version
is published. The per-rank loop lives in :mod:`training.loop`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from serving.registry import CheckpointStore, RegistryError, check_name
from training.data import TASKS
from training.model import SIZES

__all__ = ["DEFAULT_CHECKPOINT_EVERY", "TrainingError", "main", "train"]

DEFAULT_CHECKPOINT_EVERY = 200
LOG_EVERY = 50
JOB_FILE = "job.json"


class TrainingError(RuntimeError):
    """The job cannot start or finish (bad arguments, a run directory from other arguments...)."""


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


def _resolve_size(store: CheckpointStore, model: str, size: str | None, parent: str | None) -> str:
    if parent is None:
        size = size or "tiny"
    else:
        parent_size = store.verify(model, parent).size
        if size not in (None, parent_size):
            raise TrainingError(f"--size {size} differs from parent {model}@{parent} ({parent_size})")
        size = parent_size
    if size not in SIZES:
        raise TrainingError(f"unknown size {size!r}; expected one of {', '.join(SIZES)}")
    return size


def _claim_run_dir(store: CheckpointStore, model: str, version: str, job: dict[str, Any]) -> str:
    """Record the job's arguments in its run directory; refuse to resume a different job."""
    run = store.run_path(model, version)
    job_file = f"{run}/{JOB_FILE}"
    if store.fs.isfile(job_file):
        previous = json.loads(store.fs.cat_file(job_file))
        if previous != job:
            diff = {k: (previous.get(k), v) for k, v in job.items() if previous.get(k) != v}
            raise TrainingError(
                f"{store.fs.unstrip_protocol(run)} holds a run of {model}@{version} with other "
                f"arguments (was, now): {diff}; rerun with the same arguments to resume, or delete "
                "that directory to start over"
            )
    else:
        store.fs.makedirs(run, exist_ok=True)
        store.fs.pipe_file(job_file, json.dumps(job, sort_keys=True).encode())
    return run


def _init_ray(workers: int, ray_address: str | None) -> bool:
    """Connect to (or start) Ray; returns whether this call started it."""
    import ray

    if ray.is_initialized():
        return False
    address = ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
    else:
        # Logical CPUs: one per rank plus headroom; each rank sets its own torch thread count.
        num_cpus = max(workers + 1, os.cpu_count() or 1)
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False)
    return True


def _run_trainer(store: CheckpointStore, run: str, config: dict[str, Any], workers: int, use_gpu: bool | None) -> Any:
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from training.loop import train_loop_per_worker

    if use_gpu is None:
        use_gpu = ray.cluster_resources().get("GPU", 0) >= workers
    storage_path, name = run.rsplit("/", 1)
    storage_filesystem = None
    if not store.is_local:
        from pyarrow.fs import FSSpecHandler, PyFileSystem

        storage_filesystem = PyFileSystem(FSSpecHandler(store.fs))
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=use_gpu),
        run_config=RunConfig(
            name=name,
            storage_path=storage_path,
            storage_filesystem=storage_filesystem,
            checkpoint_config=CheckpointConfig(num_to_keep=2),
            failure_config=FailureConfig(max_failures=0),
        ),
    )
    return trainer.fit()


def train(
    model: str,
    version: str,
    task: str,
    root: str,
    size: str | None = "tiny",
    steps: int | None = None,
    workers: int = 2,
    parent: str | None = None,
    seed: int = 0,
    *,
    checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY,
    use_gpu: bool | None = None,
    ray_address: str | None = None,
    keep_run: bool = False,
) -> dict[str, Any]:
    """Train ``model@version`` on ``task`` with Ray Train and publish it under ``root``.

    ``size`` defaults to the parent's size when ``parent`` is given (pass ``None``); with a parent
    the weights start from that verified version. ``steps`` defaults to the size's tested default.
    Ray is started locally unless it is already initialised, ``ray_address`` is given or
    ``RAY_ADDRESS`` is set. Returns the published manifest as a dict.
    """
    check_name("model", model)
    check_name("version", version)
    if task not in TASKS:
        raise TrainingError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")
    if workers < 1 or checkpoint_every < 1 or (steps is not None and steps < 1):
        raise TrainingError("workers, steps and checkpoint_every must be >= 1")
    store = CheckpointStore(root)
    if store.exists(model, version):
        raise TrainingError(
            f"{model}@{version} already exists at {store.uri(model, version)}; "
            "versions are immutable, pick a new version name"
        )
    size = _resolve_size(store, model, size, parent)
    spec = SIZES[size]
    steps = steps or spec.steps
    job = {"model": model, "version": version, "task": task, "size": size, "steps": steps}
    job |= {"parent": parent, "seed": seed, "batch_size": spec.batch_size, "peak_lr": spec.peak_lr}
    run = _claim_run_dir(store, model, version, job)
    config = {
        "label": f"{model}@{version}",
        "task": task,
        "size": size,
        "steps": steps,
        "seed": seed,
        "batch_size": spec.batch_size,
        "peak_lr": spec.peak_lr,
        "checkpoint_every": checkpoint_every,
        "log_every": min(LOG_EVERY, checkpoint_every),
        "parent_dir": store.local_path(model, parent) if parent else None,
    }

    started_ray = _init_ray(workers, ray_address)
    t0 = time.monotonic()
    try:
        result = _run_trainer(store, run, config, workers, use_gpu)
        if result.checkpoint is None:
            raise TrainingError(f"{model}@{version}: the run reported no checkpoint")
        with result.checkpoint.as_directory() as directory:
            outcome = json.loads((Path(directory) / "result.json").read_text())
            fields = {
                "model": model,
                "version": version,
                "parent_version": parent,
                "task": task,
                "size": size,
                "steps": outcome["steps"],
                "final_loss": outcome["final_loss"],
                "eval": outcome["eval"],
                "code_revision": code_revision(),
                "seed": seed,
                "workers": workers,
                "resumed_from_step": outcome["resumed_from_step"],
                "wall_s": round(time.monotonic() - t0, 1),
            }
            manifest = store.publish(Path(directory) / "hf", fields)
    finally:
        if started_ray:
            import ray

            ray.shutdown()
    if not keep_run:
        store.fs.rm(run, recursive=True)
        runs = run.rsplit("/", 1)[0]
        if store.fs.isdir(runs) and not store.fs.ls(runs):
            store.fs.rmdir(runs)
    return manifest.model_dump(mode="json")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m training.train",
        description="Train a small Llama on an arithmetic task (Ray Train, DDP) and publish "
        "<root>/<model>/<version>/ with a manifest.",
    )
    p.add_argument("--model", required=True, help="model name (a directory under --root)")
    p.add_argument("--version", required=True, help="new, immutable version name")
    p.add_argument("--task", required=True, choices=TASKS)
    p.add_argument("--root", required=True, help="checkpoint store: local path or fsspec URI")
    p.add_argument("--size", choices=tuple(SIZES), default=None, help="default: tiny, or the parent's size")
    p.add_argument("--steps", type=int, default=None, help="default: the size's tested default")
    p.add_argument("--workers", type=int, default=2, help="DDP ranks (Ray Train workers)")
    p.add_argument("--parent", default=None, help="start from this version's weights")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=DEFAULT_CHECKPOINT_EVERY)
    p.add_argument("--keep-run", action="store_true", help="keep Ray Train state after publishing")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        manifest = train(
            args.model,
            args.version,
            args.task,
            args.root,
            size=args.size,
            steps=args.steps,
            workers=args.workers,
            parent=args.parent,
            seed=args.seed,
            checkpoint_every=args.checkpoint_every,
            keep_run=args.keep_run,
        )
    except (TrainingError, RegistryError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    path = CheckpointStore(args.root).uri(args.model, args.version)
    print(f"published {args.model}@{args.version} to {path}")
    print(json.dumps({k: v for k, v in manifest.items() if k != "files"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
