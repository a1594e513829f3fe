"""A training run's directory in the store, ``<root>/<model>/.runs/<version>/``: where Ray Train
writes the run's checkpoints, with the job's arguments in ``job.json``. A rerun with the same
arguments resumes from the last checkpoint; one with other arguments is refused while a checkpoint
is there (:class:`RunConflict`). One job at a time holds it (:mod:`training.run_lock`).
"""

from __future__ import annotations

import json
from typing import Any

from serving.registry import CheckpointStore

__all__ = ["JOB_FILE", "RunConflict", "checkpoints", "claim_run_dir", "what_is_left"]

JOB_FILE = "job.json"


class RunConflict(Exception):
    """The run directory holds checkpoints of a run with other arguments."""


def claim_run_dir(store: CheckpointStore, model: str, version: str, job: dict[str, Any]) -> str:
    """Record the job's arguments in its run directory. A run with a checkpoint resumes only with
    the same arguments; one without (it failed before its first) holds nothing to resume and is
    replaced."""
    run = store.run_path(model, version)
    job_file = f"{run}/{JOB_FILE}"
    if store.fs.isfile(job_file):
        try:
            previous = json.loads(store.fs.cat_file(job_file))
        except ValueError:  # cut short by a crash: a run that never got to its first checkpoint
            previous = {}
        if previous == job:
            return run
        if checkpoints(store, run):
            diff = {k: (previous.get(k), v) for k, v in job.items() if previous.get(k) != v}
            raise RunConflict(
                f"{store.fs.unstrip_protocol(run)} holds a run of {model}@{version} with other "
                f"arguments (was, now): {diff}; rerun with the same arguments to resume, or delete "
                "that directory to start over"
            )
        store.fs.rm(run, recursive=True)
    store.fs.makedirs(run, exist_ok=True)
    store.fs.pipe_file(job_file, json.dumps(job, sort_keys=True).encode())
    return run


def checkpoints(store: CheckpointStore, run: str) -> list[str]:
    """The checkpoint directories Ray Train wrote in ``run`` (``checkpoint_<step>``)."""
    if not store.fs.isdir(run):
        return []
    entries = store.fs.ls(run, detail=True)
    names = [str(e["name"]).rstrip("/").rsplit("/", 1)[-1] for e in entries if e["type"] == "directory"]
    return sorted(n for n in names if n.startswith("checkpoint_"))


def what_is_left(store: CheckpointStore, run: str) -> str:
    """What a failed run leaves the user: a checkpoint to resume from, or a clean slate."""
    if not checkpoints(store, run):
        return "nothing was checkpointed: a corrected command starts afresh"
    where = store.fs.unstrip_protocol(run)
    return f"its checkpoints stay in {where}: rerun the same command to resume, or delete it to start over"
