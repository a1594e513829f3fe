"""Moving a published version into place on an object store, where no rename is atomic.

The version's files were uploaded under a temporary prefix of the publisher's own; here they are
moved under ``<model>/<version>/`` one by one, the manifest last, so a reader never lists a version
before it is whole. Two things make that safe:

- **One publisher at a time** per ``model@version``: a lease (:class:`serving.lease.StoreLock`,
  ``<model>/.publish/<version>/lock.json``, a conditional write on S3) is held while the files
  move, and checked once more before the manifest moves. Two jobs that publish the same name at
  once (an import and a training job, two imports) cannot both succeed or interleave their files.
- **A publish that died part way** (a network error, a killed process) leaves files without a
  manifest, which no reader lists. Under the lease nobody else is publishing that name, so such a
  leftover is removed and the version published anew, rather than the name being lost for good.

Each file moves by its exact key (``cp_file`` then ``rm_file``): fsspec's ``mv`` expands glob
characters, so a file named ``model-*.bin`` would land elsewhere.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from fsspec import AbstractFileSystem

from serving.lease import LeaseFile, LockLost, StoreLock, holder_name
from serving.manifest import MANIFEST

__all__ = ["PUBLISH_DIR", "move_into_place"]

PUBLISH_DIR = ".publish"
LEASE_TTL_S = 60.0
WAIT_S = 300.0  # for another publisher of the same name to finish (or its lease to lapse)


def move_into_place(
    fs: AbstractFileSystem, tmp: str, final: str, order: Sequence[str], label: str, wait_s: float | None = None
) -> str | None:
    """Move ``order`` (relative paths, the manifest last) from ``tmp`` to ``final``; returns why
    not (the version exists, or another publisher held the name for ``wait_s``, default
    :data:`WAIT_S`) or None once it is in place."""
    wait_s = WAIT_S if wait_s is None else wait_s
    model_dir, version = final.rstrip("/").rsplit("/", 1)
    lock = StoreLock(LeaseFile(fs, f"{model_dir}/{PUBLISH_DIR}/{version}"), holder_name(), LEASE_TTL_S)
    deadline = time.monotonic() + wait_s
    while not lock.acquire():
        if time.monotonic() > deadline:
            return f"{label} is being published by another job (its lease did not lapse in {wait_s:.0f}s)"
        time.sleep(2)
    try:
        return lock.hold_while(f"publishing {label}", _move, fs, tmp, final, order, label, lock)
    except LockLost as exc:
        return f"{label}: {exc}"
    finally:
        lock.release()


def _move(
    fs: AbstractFileSystem, tmp: str, final: str, order: Sequence[str], label: str, lock: StoreLock
) -> str | None:
    if fs.exists(f"{final}/{MANIFEST}"):
        return f"{label} appeared while publishing"
    if fs.exists(final):  # a publish of this name that died part way: nobody else holds the name
        fs.rm(final, recursive=True)
    for rel in order:
        if rel == MANIFEST and not lock.held():  # the version becomes visible only to the holder
            return f"{label}: the publish lease was lost before the manifest moved"
        fs.makedirs(f"{final}/{rel}".rsplit("/", 1)[0], exist_ok=True)
        fs.cp_file(f"{tmp}/{rel}", f"{final}/{rel}")
        fs.rm_file(f"{tmp}/{rel}")
    return None
