"""The promotion controller's durable state, kept in the checkpoint store beside the checkpoints.

Why the store: it is the one place that outlives a controller replica, a head restart and a
blue/green cluster replacement, and that the training job, ``serving up``, ``serving render-k8s``
and every cluster of a stack can all reach (a local path, a PVC or an ``s3://`` bucket)::

    <root>/.control/<stack>/live.json                   live versions and weights of every model
    <root>/.control/<stack>/lock.json                   the active controller's lease
    <root>/.control/<stack>/requests/<model>/<key>.json  CLI requests waiting for the controller, oldest first
    <root>/.control/<stack>/promotions/<model>/<id>.json one record per promotion, steps appended

``live.json`` is what serves: each step is written into the promotion's record (marked
``live_pending``), then into ``live.json``, before it is applied, and the mark is cleared; the
controller writes a step still marked into ``live.json`` at its next poll. So whatever reads
``live.json`` (a restarted controller, ``serving up``) applies the step that was in progress, never
an older one. Every file is replaced whole (write, then read back).

The lock is a lease: ``{holder, token, expires_at}``. A controller takes it when it is absent,
expired or its own, renews it every poll and checks it before every write; a controller that sees
another holder's unexpired lease only watches. Taking or renewing it is a compare-and-set:

- on a local (or NFS) store, under an ``flock``;
- on S3 (s3fs), a conditional write: ``If-None-Match: *`` creates the lease only if there is none,
  ``If-Match: <ETag read>`` replaces exactly the lease that was read, so of two clusters that read
  the same expired lease one write succeeds and the other gets 412 and watches;
- on another object store, which has no conditional write through fsspec, write then read back
  after a settle delay (the later writer wins and the earlier sees it lost).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

import fsspec
from fsspec.implementations.local import LocalFileSystem
from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ACTIVE",
    "ControlStore",
    "LiveVersion",
    "PromotionRecord",
    "PromotionRequest",
    "StepRecord",
    "StoreLock",
]

Status = Literal["deploying", "stepping", "finishing", "promoted", "rolled_back", "refused", "aborted"]
ACTIVE: frozenset[str] = frozenset({"deploying", "stepping", "finishing"})


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LiveVersion(_Doc):
    version: str
    weight: int = Field(ge=0, le=100)


class StepRecord(_Doc):
    """One decision of a promotion: what was applied or judged, with its figures."""

    at: float
    phase: str  # deploy | warm | step | extend | hold | eval | finish | promoted | rollback | refused
    weights: dict[str, int] = {}
    figures: dict[str, float | None] = {}
    note: str = ""


class PromotionRecord(_Doc):
    id: str
    model: str
    version: str
    previous: str
    source: Literal["auto", "manual"]
    status: Status = "deploying"
    step_index: int = -1  # index into the policy's steps; -1 = not yet taking traffic
    step_started_at: float = 0.0
    extensions: int = 0
    baseline: dict[str, Any] = {}  # metric totals at the start of the step being watched
    policy: dict[str, Any] = {}
    reason: str = ""
    live_pending: bool = False  # its last step with weights is recorded but not yet in live.json
    created_at: float
    updated_at: float
    steps: list[StepRecord] = []

    @property
    def active(self) -> bool:
        return self.status in ACTIVE


class PromotionRequest(_Doc):
    action: Literal["promote", "abort", "rollback"]
    version: str | None = None
    overrides: dict[str, Any] = {}
    at: float


class ControlStore:
    """Read and write the controller's files under ``<root>/.control/<stack>``."""

    def __init__(self, root: str, stack: str) -> None:
        self.root, self.stack = root, stack
        self.fs, path = fsspec.core.url_to_fs(root)
        self.base = f"{path.rstrip('/')}/.control/{stack}"

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    def _read(self, rel: str) -> bytes | None:
        self.fs.invalidate_cache()
        try:
            return bytes(self.fs.cat_file(f"{self.base}/{rel}"))
        except FileNotFoundError:
            return None

    def _write(self, rel: str, data: bytes) -> None:
        path = f"{self.base}/{rel}"
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        if self.is_local:  # whole or nothing: a reader never sees half a file
            tmp = f"{path}.tmp-{secrets.token_hex(4)}"
            with open(tmp, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
        else:
            self.fs.pipe_file(path, data)

    def _delete(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(f"{self.base}/{rel}")

    # -- live versions ------------------------------------------------------------------------

    def live(self) -> dict[str, list[LiveVersion]]:
        raw = self._read("live.json")
        if raw is None:
            return {}
        data: dict[str, dict[str, list[dict[str, Any]]]] = json.loads(raw)
        return {m: [LiveVersion.model_validate(v) for v in vs] for m, vs in data["models"].items()}

    def set_live(self, model: str, versions: list[tuple[str, int]]) -> None:
        """Record ``model``'s versions and weights, keeping every other model's as they are now."""
        current = {m: [v.model_dump() for v in vs] for m, vs in self.live().items()}
        current[model] = [{"version": v, "weight": w} for v, w in versions]
        self._write("live.json", json.dumps({"models": current}, indent=2).encode())

    # -- promotions ---------------------------------------------------------------------------

    def save(self, record: PromotionRecord) -> None:
        record.updated_at = time.time()
        self._write(f"promotions/{record.model}/{record.id}.json", record.model_dump_json(indent=2).encode())

    def history(self, model: str) -> list[PromotionRecord]:
        """Every promotion of ``model``, oldest first."""
        self.fs.invalidate_cache()
        folder = f"{self.base}/promotions/{model}"
        if not self.fs.isdir(folder):
            return []
        records = []
        for path in self.fs.ls(folder, detail=False):
            if path.endswith(".json"):
                records.append(PromotionRecord.model_validate_json(bytes(self.fs.cat_file(path))))
        return sorted(records, key=lambda r: r.created_at)

    def active(self, model: str) -> PromotionRecord | None:
        return next((r for r in reversed(self.history(model)) if r.active), None)

    def tried(self, model: str) -> set[str]:
        """Versions a promotion of ``model`` has already started or refused (auto mode skips them)."""
        return {r.version for r in self.history(model)}

    def models_with_history(self) -> list[str]:
        folder = f"{self.base}/promotions"
        self.fs.invalidate_cache()
        if not self.fs.isdir(folder):
            return []
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(folder, detail=False))

    # -- requests -----------------------------------------------------------------------------

    def submit(self, model: str, request: PromotionRequest, key: str | None = None) -> str:
        """Queue ``request`` for the controller; returns its key. Each request is a file of its own
        (named by the time it was made), so two made at once are both taken, one per poll, oldest
        first. ``key``: put back a request that was taken, where it was."""
        key = key or f"{time.time_ns():020d}-{secrets.token_hex(4)}"
        self._write(f"requests/{model}/{key}.json", request.model_dump_json().encode())
        return key

    def _request_keys(self, model: str) -> list[str]:
        folder = f"{self.base}/requests/{model}"
        self.fs.invalidate_cache()
        try:
            paths = self.fs.ls(folder, detail=False)
        except FileNotFoundError:
            return []
        names = (p.rstrip("/").rsplit("/", 1)[-1] for p in paths)
        return sorted(n[: -len(".json")] for n in names if n.endswith(".json"))

    def take_request(self, model: str) -> tuple[str, PromotionRequest] | None:
        """The oldest request waiting for ``model`` and its key, removed from the queue."""
        for key in self._request_keys(model):
            raw = self._read(f"requests/{model}/{key}.json")
            if raw is None:  # taken in between
                continue
            self._delete(f"requests/{model}/{key}.json")
            return key, PromotionRequest.model_validate_json(raw)
        return None

    def pending_request(self, model: str, key: str | None = None) -> PromotionRequest | None:
        """The request ``key`` if it still waits, else (no key) the oldest one waiting."""
        for k in [key] if key else self._request_keys(model):
            raw = self._read(f"requests/{model}/{k}.json")
            if raw is not None:
                return PromotionRequest.model_validate_json(raw)
        return None

    # -- lock primitives (used by StoreLock) ----------------------------------------------------

    @contextlib.contextmanager
    def _mutex(self) -> Iterator[None]:
        if not self.is_local:
            yield
            return
        os.makedirs(self.base, exist_ok=True)
        with open(f"{self.base}/lock.flock", "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def read_lock(self) -> dict[str, Any] | None:
        raw = self._read("lock.json")
        return None if raw is None else dict(json.loads(raw))

    @property
    def conditional(self) -> bool:
        """Whether writes can be made conditional on what was read (S3's If-Match/If-None-Match)."""
        return "s3" in tuple(self.fs.protocol)

    def read_lock_tagged(self) -> tuple[dict[str, Any] | None, str | None]:
        """The lease and the ETag it was read under (``None, None`` when there is none).

        The ETag is read first: if the object changes before its body is read, the conditional
        write with the older ETag fails, which is the safe outcome."""
        path = f"{self.base}/lock.json"
        try:
            etag = str(self.fs.info(path, refresh=True)["ETag"])
        except FileNotFoundError:
            return None, None
        return self.read_lock(), etag

    def write_lock_if(self, body: dict[str, Any], etag: str | None) -> bool:
        """Write the lease only if the object is still the one read under ``etag`` (``None``: only
        if there is none); False when another writer got there first."""
        path, data = f"{self.base}/lock.json", json.dumps(body).encode()
        try:
            if etag is None:
                self.fs.pipe_file(path, data, mode="create")
            else:
                self.fs.pipe_file(path, data, IfMatch=etag)
        except (FileExistsError, FileNotFoundError):  # created, or deleted, since it was read
            return False
        except OSError as exc:  # s3fs raises 412 Precondition Failed as EINVAL
            if exc.errno == errno.EINVAL:
                return False
            raise
        return True


class StoreLock:
    """The lease that makes one controller of a stack active (see the module docstring)."""

    def __init__(
        self,
        store: ControlStore,
        holder: str,
        ttl_s: float,
        clock: Callable[[], float] = time.time,
        settle_s: float = 1.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.store, self.holder, self.ttl_s = store, holder, ttl_s
        self.clock, self.settle_s, self.sleep = clock, settle_s, sleep
        self.token = secrets.token_hex(8)

    def _claim(self, current: dict[str, Any] | None) -> dict[str, Any] | None:
        """The lease to write over ``current``, or None while another holder's has not expired."""
        now = self.clock()
        if current and current.get("token") != self.token and float(current.get("expires_at", 0)) > now:
            return None
        return {"holder": self.holder, "token": self.token, "expires_at": now + self.ttl_s}

    def acquire(self) -> bool:
        """Take or renew the lease; False if another holder's lease has not expired."""
        if self.store.conditional:
            current, etag = self.store.read_lock_tagged()
            body = self._claim(current)
            return body is not None and self.store.write_lock_if(body, etag)
        with self.store._mutex():
            body = self._claim(self.store.read_lock())
            if body is None:
                return False
            self.store._write("lock.json", json.dumps(body).encode())
        if not self.store.is_local:  # no mutex: the last writer wins, so look again
            self.sleep(self.settle_s)
        return self.held()

    def held(self) -> bool:
        current = self.store.read_lock()
        return bool(current and current.get("token") == self.token and float(current["expires_at"]) > self.clock())

    def release(self) -> None:
        if self.store.conditional:  # expire it, only if it is still ours
            current, etag = self.store.read_lock_tagged()
            if current and current.get("token") == self.token:
                self.store.write_lock_if(current | {"expires_at": 0.0}, etag)
            return
        with self.store._mutex():
            if self.held():
                self.store._delete("lock.json")
