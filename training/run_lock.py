"""One training job per ``model@version`` at a time.

Two jobs for the same version (a RayJob submitted twice, a rerun while the first still runs)
would write checkpoints into the same run directory and race to publish. The job therefore holds a
lock beside its run directory (``<root>/<model>/.runs/<version>.lock``) from before it claims the
run until after it published or failed; a second job is refused at once with who holds it.

- A local (or NFS) store: an ``flock`` on that file, held by the job's driver process. The kernel
  drops it when the process dies, so a killed job's rerun is never locked out.
- An object store (``s3://`` ...): a lease, ``<version>.lock/lock.json``, taken and renewed like
  the promotion controller's (:class:`serving.lease.StoreLock`: a conditional write on S3) every
  ``ttl_s / 4`` by a thread of the driver. A driver that dies holds it until ``ttl_s`` passes.
  The lease is expired and then deleted at the end; a job that takes it between those two calls
  loses it (the window is one request).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime

from serving.lease import LeaseFile, StoreLock
from serving.registry import CheckpointStore

__all__ = ["RunLocked", "run_lock"]


class RunLocked(RuntimeError):
    """Another job holds the version's lock."""


def _holder() -> str:
    return f"{socket.gethostname()} pid {os.getpid()} since {datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC"


@contextlib.contextmanager
def run_lock(store: CheckpointStore, model: str, version: str, ttl_s: float = 60.0) -> Iterator[None]:
    """Hold ``model@version``'s training lock for the ``with`` block, or raise :class:`RunLocked`."""
    path = f"{store.run_path(model, version)}.lock"
    label = f"{model}@{version}"
    if store.is_local:
        with _flock(path, label):
            yield
    else:
        with _lease(store, path, label, ttl_s):
            yield


@contextlib.contextmanager
def _flock(path: str, label: str) -> Iterator[None]:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            with open(fd, closefd=True) as fh:
                holder = fh.read().strip() or "another process"
            raise RunLocked(f"another training job of {label} is running ({holder}); lock file {path}") from None
        try:  # the file a releasing holder unlinked is not the lock any more: take the new one
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, _holder().encode())
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # while still held: the next job creates a fresh file
        os.close(fd)


@contextlib.contextmanager
def _lease(store: CheckpointStore, path: str, label: str, ttl_s: float) -> Iterator[None]:
    lease = LeaseFile(store.fs, path)  # lock.json in <version>.lock/
    lock = StoreLock(lease, _holder(), ttl_s)
    if not lock.acquire():
        current = lease.read() or {}
        holder, until = current.get("holder", "another job"), float(current.get("expires_at", 0)) - time.time()
        raise RunLocked(
            f"another training job of {label} is running ({holder}); its lease at "
            f"{lease.where()} lapses in {max(until, 0):.0f}s unless that job renews it"
        )
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(ttl_s / 4):
            with contextlib.suppress(Exception):  # a failed renewal is retried until the lease lapses
                lock.acquire()

    thread = threading.Thread(target=renew, name=f"run-lock {label}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)
        lock.release()
        with contextlib.suppress(FileNotFoundError):
            store.fs.rm(path, recursive=True)
