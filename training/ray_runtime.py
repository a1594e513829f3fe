"""Where the training job's Ray Train run executes, and the trainer it runs.

The job either joins a Ray that is already there (``ray_address``, ``RAY_ADDRESS``, or one this
process initialised: a stack's head, a RayJob's cluster) or starts a private one for itself: token
authentication with a token only its own environment holds, loopback only, no dashboard or job
API, stopped when the job ends. Ray reads those settings when it is first imported, so a private
instance can only start in a process that has not imported Ray yet (:class:`PrivateRayRefused`).
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
from collections.abc import Callable, Mapping
from typing import Any

from serving.config import LOCAL_RAY_LOOPBACK
from serving.registry import CheckpointStore

__all__ = ["PrivateRayRefused", "init_ray", "run_trainer"]

PREEMPTION_WATCHER = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
HEALTH_CHECK_INTERVAL = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"


class PrivateRayRefused(RuntimeError):
    """A private Ray cannot be started in this process (it imported Ray already)."""


def init_ray(workers: int, ray_address: str | None) -> Callable[[], None] | None:
    """Connect to (or start) Ray; returns how to stop it when this call started it.

    Ray reads its authentication mode and whether its node may take a network address when it is
    first imported, so the job starts a private instance (token authentication, loopback only)
    only in a process that has not imported Ray yet: the CLI, the subprocess ``serving up`` runs.
    In any other process it uses the Ray already initialised there, or the one at ``ray_address``
    (``RAY_ADDRESS``), and refuses to start one (:func:`_refuse_private_ray`)."""
    address = ray_address or os.environ.get("RAY_ADDRESS")
    fresh = "ray" not in sys.modules
    restore = _private_ray_auth() if fresh and not address else None
    if fresh and address and address.split("://")[-1].rsplit(":", 1)[0] in ("127.0.0.1", "localhost"):
        _set_environ(LOCAL_RAY_LOOPBACK)  # a local stack's head (serving.control.stack.ray_env)
    import ray

    if ray.is_initialized():
        return None
    if address:
        ray.init(address=address, log_to_driver=True)
        return ray.shutdown
    _refuse_private_ray(fresh)
    # Logical CPUs: one per rank plus headroom; each rank sets its own torch thread count. No
    # dashboard and no job API: nothing but this process uses the instance (_private_trainer).
    num_cpus = max(workers + 1, os.cpu_count() or 1)
    # Ray Train's preemption watcher polls for nodes being drained; this instance is one node that
    # lives and dies with this process, and the watcher's creation logs an internal error line.
    # The controller polls its workers every 2 s by default, and each step of the worker group's
    # start and end waits for a poll: every 0.5 s, a job ends about 3 s sooner (docs/training.md).
    put_back = _set_environ({PREEMPTION_WATCHER: "0", HEALTH_CHECK_INTERVAL: "0.5"})
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING)

    def stop() -> None:
        ray.shutdown()
        put_back()
        if restore is not None:
            restore()

    return stop


def _refuse_private_ray(fresh: bool) -> None:
    """Raise unless this process imported Ray only after :func:`_private_ray_auth` set its
    environment: a Ray started here otherwise has no token authentication, and its daemons and
    metrics ports listen on the machine's network address."""
    if not fresh:
        raise PrivateRayRefused(
            "this process imported Ray before the training job could set up its private Ray "
            "(token authentication, loopback only, which Ray reads when first imported); pass "
            "ray_address (or set RAY_ADDRESS) to train on a running cluster, or run the job in a "
            "process of its own: python -m training.train"
        )


def _set_environ(values: Mapping[str, str | None]) -> Callable[[], None]:
    """Set ``values`` in this process's environment (Ray's processes inherit it; ``None`` removes
    a variable); returns what puts each variable back as it was, or removes it."""
    saved = {k: os.environ.get(k) for k in values}
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value

    def put_back() -> None:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    return put_back


def _private_ray_auth() -> Callable[[], None]:
    """Token authentication for the job's own Ray instance: a random token held only in this
    process's environment (which Ray's processes inherit and no other user can read), never in a
    file, so a killed job leaves no token behind; and loopback only (``LOCAL_RAY_LOOPBACK``: its
    GCS, its workers and the DDP ranks' rendezvous on 127.0.0.1). Returns what puts the
    environment back."""
    token = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_AUTH_TOKEN_PATH": None}
    return _set_environ({**token, **LOCAL_RAY_LOOPBACK})


def _private_trainer(base: Any) -> Any:
    """``TorchTrainer`` without Ray Train's placement-group cleaner, for the job's own Ray.

    The cleaner is a detached actor that polls Ray's state API (served by the dashboard) every
    second to remove the job's placement group should the controller die ungracefully. On a
    private instance that lives and dies with this process there is nothing to clean, and without
    a dashboard each poll fails with a warning on the console.
    """
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    class Trainer(base):  # type: ignore[misc]
        def _create_default_callbacks(self) -> list[Any]:
            callbacks = super()._create_default_callbacks()
            return [c for c in callbacks if not isinstance(c, PlacementGroupCleanerCallback)]

    return Trainer


def run_trainer(
    store: CheckpointStore, run: str, config: dict[str, Any], workers: int, use_gpu: bool | None, private: bool
) -> Any:
    import ray
    from ray.train.v2.api.config import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.v2.torch.torch_trainer import TorchTrainer

    from training.loop import train_loop_per_worker

    if use_gpu is None:
        use_gpu = ray.cluster_resources().get("GPU", 0) >= workers
    storage_path, name = run.rsplit("/", 1)
    storage_filesystem = None
    if not store.is_local:
        from pyarrow.fs import FSSpecHandler, PyFileSystem

        storage_filesystem = PyFileSystem(FSSpecHandler(store.fs))
    trainer = (_private_trainer(TorchTrainer) if private else TorchTrainer)(
        train_loop_per_worker,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=use_gpu),
        run_config=RunConfig(
            name=name,
            storage_path=storage_path,
            storage_filesystem=storage_filesystem,
            checkpoint_config=CheckpointConfig(num_to_keep=2),
            failure_config=FailureConfig(max_failures=0),
            # Ray Train logs every report() at INFO on the console; warnings and errors still show.
            logging_config=LoggingConfig(log_level="WARNING"),
        ),
    )
    return trainer.fit()
