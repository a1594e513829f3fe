"""The promotion controller's durable state, kept in the checkpoint store beside the checkpoints.

Why the store: it is the one place that outlives a controller replica, a head restart and a
blue/green cluster replacement, and that the training job, ``serving up``, ``serving render-k8s``
and every cluster of a stack can all reach (a local path, a PVC or an ``s3://`` bucket)::

    <root>/.control/<stack>/live.json                   live versions and weights of every model
    <root>/.control/<stack>/lock.json                   the active controller's lease
    <root>/.control/<stack>/requests/<model>/<key>.json  CLI requests waiting for the controller, oldest first
    <root>/.control/<stack>/requests/<model>.json        a request in the single file older controllers read: first
    <root>/.control/<stack>/promotions/<model>/<id>.json one record per promotion, steps appended

``live.json`` is what serves: each model's versions and weights, and for a version the controller
promoted, the sha256 of the manifest its gate checked (``manifest_sha256``), which that version's
replicas hold the store's manifest to. Each step is written into the promotion's record (marked
``live_pending``), then into ``live.json``, before it is applied, and the mark is cleared; the
controller writes a step still marked into ``live.json`` at its next poll. So whatever reads
``live.json`` (a restarted controller, ``serving up``) applies the step that was in progress, never
an older one. Every file is replaced whole (write, then read back).

The lock is a lease (:mod:`serving.lease`) in ``lock.json``: one controller of a stack is active.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Sequence
from typing import Any, Literal

import fsspec
from pydantic import BaseModel, ConfigDict, Field

from serving.lease import LeaseFile, delete_file, read_file, write_whole

__all__ = [
    "ACTIVE",
    "ControlStore",
    "LiveEntry",
    "LiveVersion",
    "PromotionRecord",
    "PromotionRequest",
    "StepRecord",
    "pin_of",
]

Status = Literal["deploying", "stepping", "finishing", "promoted", "rolled_back", "refused", "aborted"]
ACTIVE: frozenset[str] = frozenset({"deploying", "stepping", "finishing"})


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid")


# A live version as the record gives it: (version, weight), or (version, weight, manifest sha256) pinned.
LiveEntry = tuple[str, int] | tuple[str, int, str]


def pin_of(entry: LiveEntry) -> str | None:
    """The manifest sha256 a live entry pins, if any."""
    return entry[2] if len(entry) == 3 else None


class LiveVersion(_Doc):
    version: str
    weight: int = Field(ge=0, le=100)
    manifest_sha256: str | None = None

    def entry(self) -> LiveEntry:
        if self.manifest_sha256:
            return (self.version, self.weight, self.manifest_sha256)
        return (self.version, self.weight)


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
    manifest_sha256: str | None = None  # of the manifest its gate checked: the version's pin in live.json
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
        self.lease = LeaseFile(self.fs, self.base)  # the active controller's lease, lock.json

    def _read(self, rel: str) -> bytes | None:
        return read_file(self.fs, f"{self.base}/{rel}")

    def _write(self, rel: str, data: bytes) -> None:
        write_whole(self.fs, f"{self.base}/{rel}", data)

    def _delete(self, rel: str) -> None:
        delete_file(self.fs, f"{self.base}/{rel}")

    # -- live versions ------------------------------------------------------------------------

    def live(self) -> dict[str, list[LiveVersion]]:
        raw = self._read("live.json")
        if raw is None:
            return {}
        data = json.loads(raw)
        models = data.get("models") if isinstance(data, dict) else None
        if not isinstance(models, dict) or not all(isinstance(vs, list) for vs in models.values()):
            raise ValueError(f'{self.base}/live.json is not {{"models": {{model: [versions]}}}}')
        return {str(m): [LiveVersion.model_validate(v) for v in vs] for m, vs in models.items()}

    def set_live(self, model: str, versions: Sequence[LiveEntry]) -> None:
        """Record ``model``'s versions and weights, keeping every other model's as they are now. A
        version given without a pin keeps the one recorded for it."""
        live = self.live()
        pinned = {v.version: v.manifest_sha256 for v in live.get(model, [])}
        live[model] = [
            LiveVersion(version=e[0], weight=e[1], manifest_sha256=pin_of(e) or pinned.get(e[0])) for e in versions
        ]
        current = {m: [v.model_dump(exclude_none=True) for v in vs] for m, vs in live.items()}
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
        self._write(_request_file(model, key), request.model_dump_json().encode())
        return key

    def _request_keys(self, model: str) -> list[str]:
        """The keys of ``model``'s waiting requests, oldest first. A request in the single file
        ``requests/<model>.json`` (where controllers before the queue folder took one request per
        model) comes first: it was made before the controller that reads this was deployed."""
        folder = f"{self.base}/requests/{model}"
        self.fs.invalidate_cache()
        single = [SINGLE_KEY] if self.fs.exists(f"{self.base}/{_request_file(model, SINGLE_KEY)}") else []
        try:
            paths = self.fs.ls(folder, detail=False)
        except FileNotFoundError:
            return single
        names = (p.rstrip("/").rsplit("/", 1)[-1] for p in paths)
        return single + sorted(n[: -len(".json")] for n in names if n.endswith(".json"))

    def take_request(self, model: str) -> tuple[str, PromotionRequest] | None:
        """The oldest request waiting for ``model`` and its key, removed from the queue."""
        for key in self._request_keys(model):
            raw = self._read(_request_file(model, key))
            if raw is None:  # taken in between
                continue
            self._delete(_request_file(model, key))
            return key, PromotionRequest.model_validate_json(raw)
        return None

    def pending_request(self, model: str, key: str | None = None) -> PromotionRequest | None:
        """The request ``key`` if it still waits, else (no key) the oldest one waiting."""
        for k in [key] if key else self._request_keys(model):
            raw = self._read(_request_file(model, k))
            if raw is not None:
                return PromotionRequest.model_validate_json(raw)
        return None


SINGLE_KEY = "single"  # the key of a request in ``requests/<model>.json``


def _request_file(model: str, key: str) -> str:
    """Where the request ``key`` of ``model`` is, relative to the stack's control folder."""
    return f"requests/{model}.json" if key == SINGLE_KEY else f"requests/{model}/{key}.json"
