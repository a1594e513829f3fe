"""Checkpoint store: list, read, verify, fetch and publish versioned model checkpoints.

Why one module for both sides: the training job writes and the serving tier reads the same layout,
so the layout and the integrity rules live in exactly one place (the manifest's schema in
:mod:`serving.manifest`)::

    <root>/<model>/<version>/            complete versions only (renamed into place when done)
        config.json, model.safetensors, tokenizer.json, ...
        manifest.json                    written last; lists every other file with its sha256
    <root>/<model>/.tmp-<version>-<hex>/ a publish in progress (never listed)
    <root>/<model>/.runs/<version>/      the training job's resumable Ray Train state (never listed)

``<root>`` is a local path or any fsspec URI (``s3://``, ``gs://``, ``memory://`` in tests). A
version directory is complete when it has a valid ``manifest.json``; :meth:`CheckpointStore.verify`
re-hashes every file so that a server never loads weights that differ from the ones evaluated.

Exception tree (all carry ``model`` and ``version``)::

    RegistryError
     +-- VersionNotFound      no such model/version directory
     +-- VersionExists        publish refused: the version is already there (never overwritten)
     +-- IncompleteVersion    no manifest, or an invalid one (e.g. a file name outside the version)
     +-- TamperedVersion      a listed file is missing or differs, or an unlisted file is present
     +-- BelowEvalGate        the manifest's gated metric is missing or misses the gate
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import secrets
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import fsspec
from fsspec.implementations.local import LocalFileSystem
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from serving.manifest import MANIFEST, Manifest, manifest_sha256
from serving.store_move import move_into_place

__all__ = [
    "BelowEvalGate",
    "CheckpointStore",
    "Gate",
    "IncompleteVersion",
    "RegistryError",
    "TamperedVersion",
    "architecture_of",
    "VersionExists",
    "VersionNotFound",
    "check_files",
    "check_name",
    "hash_tree",
    "manifest_at",
    "sha256_file",
]

RUNS_DIR: Final = ".runs"
TMP_PREFIX: Final = ".tmp-"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_CHUNK: Final = 1 << 20


class RegistryError(Exception):
    """Base of every checkpoint-store error."""

    def __init__(self, message: str, *, model: str | None = None, version: str | None = None):
        super().__init__(message)
        self.model = model
        self.version = version


class VersionNotFound(RegistryError):
    """The model or version directory does not exist."""


class VersionExists(RegistryError):
    """Publishing would overwrite an existing version."""


class IncompleteVersion(RegistryError):
    """The version directory has no manifest or an invalid one (e.g. a publish that died)."""


class TamperedVersion(RegistryError):
    """A file differs from the manifest: changed, missing, or present but not listed."""


class BelowEvalGate(RegistryError):
    """The version's evaluation score is below the required gate."""


class Gate(BaseModel):
    """A promotion gate: the manifest's ``eval.metrics[metric]`` must reach ``min`` (or stay at or
    under ``max`` for a loss). A value that is not a finite number (a run that diverged) fails any
    gate: ``nan`` compares false with every bound."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    metric: str = Field(description="A metric of the manifest's eval, e.g. exact_match or mean_token_loss.")
    min: float | None = Field(None, description="Lowest value that passes (for scores).")
    max: float | None = Field(None, description="Highest value that passes (for losses).")

    def check(self, manifest: Manifest) -> None:
        label = f"{manifest.model}@{manifest.version}"
        ids = {"model": manifest.model, "version": manifest.version}
        value = manifest.eval.value(self.metric) if manifest.eval else None
        if value is None:
            raise BelowEvalGate(f"{label}: the manifest records no {self.metric!r} to gate on", **ids)
        n = manifest.eval.n if manifest.eval else 0
        if not math.isfinite(value):
            raise BelowEvalGate(
                f"{label}: {self.metric} is {value} (n={n}), not a finite number: the run diverged", **ids
            )
        if self.min is not None and value < self.min:
            raise BelowEvalGate(f"{label}: {self.metric} {value:.4f} (n={n}) is below the gate {self.min:.4f}", **ids)
        if self.max is not None and value > self.max:
            raise BelowEvalGate(f"{label}: {self.metric} {value:.4f} (n={n}) is above the gate {self.max:.4f}", **ids)


def check_name(kind: str, name: str) -> str:
    """Model and version names become path segments: letters, digits, ``._-``, no leading dot."""
    if not _NAME.fullmatch(name):
        raise ValueError(
            f"invalid {kind} name {name!r}: use letters, digits, '.', '_' or '-' "
            "(at most 128 characters, not starting with '.', '_' or '-')"
        )
    return name


def architecture_of(directory: str | Path) -> str | None:
    """The first of ``architectures`` in a Hugging Face folder's ``config.json``, if any."""
    try:
        archs = json.loads((Path(directory) / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        return None
    return str(archs[0]) if archs else None


def _natural_key(name: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a local file."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def hash_tree(directory: str | Path) -> dict[str, str]:
    """``{relative posix path: sha256}`` of every file under a local directory but the manifest.

    A symlink to a file counts as that file (publishing copies its bytes). A symlinked folder or a
    dangling symlink raises ``ValueError``: neither is a file that could be hashed and copied, and
    leaving it out would publish a version without it.
    """
    base = Path(directory)
    paths = sorted(base.rglob("*"))
    for p in paths:
        if p.is_symlink() and not p.is_file():
            kind = "a symlinked folder" if p.is_dir() else "a dangling symlink"
            raise ValueError(f"{p} is {kind} (to {os.readlink(p)}); copy what it points to instead")
    return {
        p.relative_to(base).as_posix(): sha256_file(p)
        for p in paths
        if p.is_file() and p.relative_to(base).as_posix() != MANIFEST
    }


def check_files(manifest: Manifest, present: set[str], digest: Callable[[str], str]) -> None:
    """Raise :class:`TamperedVersion` naming the first file that is missing, differs from its
    sha256 (``digest(rel)``) or is present (in ``present``) without being listed."""
    ids = {"model": manifest.model, "version": manifest.version}
    label = f"{manifest.model}@{manifest.version}"
    for rel, expected in sorted(manifest.files.items()):
        if rel not in present:
            raise TamperedVersion(f"{label}: file {rel} is listed in the manifest but missing", **ids)
        if digest(rel) != expected:
            raise TamperedVersion(f"{label}: file {rel} does not match its sha256", **ids)
    extra = sorted(present - set(manifest.files) - {MANIFEST})
    if extra:
        raise TamperedVersion(
            f"{label}: file {extra[0]} is not listed in the manifest "
            f"({len(extra)} unlisted file(s): {', '.join(extra)})",
            **ids,
        )


def manifest_at(version_dir: str) -> Manifest | None:
    """The manifest of a version directory (a local path or fsspec URI); None when there is no
    readable one (a version still to be built, a store out of reach)."""
    try:
        fs, path = fsspec.core.url_to_fs(version_dir)
        return Manifest.model_validate_json(bytes(fs.cat_file(f"{path.rstrip('/')}/{MANIFEST}")))
    except Exception:  # noqa: BLE001 - best effort: callers decide what an unknown manifest means
        return None


def created_at(version_dir: str) -> int:
    """The Unix time a version's manifest says it was created; 0 when it has no readable
    manifest (never a failed deploy). What the gateway shows as a model's ``created``."""
    manifest = manifest_at(version_dir)
    return int(manifest.created_at.timestamp()) if manifest else 0


class CheckpointStore:
    """The checkpoint store at ``root`` (local path or fsspec URI).

    A local directory of a version that an engine can load, verified, is the node-local cache's
    business (:class:`serving.node_cache.VerifiedCache`).
    """

    def __init__(self, root: str):
        self.root = root
        self.fs, path = fsspec.core.url_to_fs(root)
        self._root_path = path.rstrip("/") or "/"

    def __repr__(self) -> str:
        return f"CheckpointStore({self.root!r})"

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    # -- paths ---------------------------------------------------------------------------------

    def _join(self, *parts: str) -> str:
        return "/".join([self._root_path.rstrip("/"), *parts])

    def version_path(self, model: str, version: str) -> str:
        """Filesystem path (no protocol) of a version directory."""
        return self._join(check_name("model", model), check_name("version", version))

    def uri(self, model: str, version: str) -> str:
        """Full URI (with protocol, unless local) of a version directory."""
        path = self.version_path(model, version)
        return path if self.is_local else self.fs.unstrip_protocol(path)

    def run_path(self, model: str, version: str) -> str:
        """Where the training job keeps its resumable Ray Train state for ``version``."""
        return self._join(check_name("model", model), RUNS_DIR, check_name("version", version))

    def _dirs(self, path: str) -> list[str]:
        if not self.fs.isdir(path):
            return []
        return [
            info["name"].rstrip("/").rsplit("/", 1)[-1]
            for info in self.fs.ls(path, detail=True)
            if info["type"] == "directory"
        ]

    # -- reading -------------------------------------------------------------------------------

    def list_models(self) -> list[str]:
        """Models with at least one complete version."""
        names = [n for n in self._dirs(self._root_path) if _NAME.fullmatch(n)]
        return sorted((n for n in names if self.list_versions(n)), key=_natural_key)

    def list_versions(self, model: str) -> list[str]:
        """Complete versions of ``model`` (those with a manifest), in natural order (v2 < v10)."""
        base = self._join(check_name("model", model))
        names = [n for n in self._dirs(base) if _NAME.fullmatch(n)]
        complete = [n for n in names if self.fs.isfile(f"{base}/{n}/{MANIFEST}")]
        return sorted(complete, key=_natural_key)

    def exists(self, model: str, version: str) -> bool:
        """Whether the name is taken: a complete version, or on a local disk anything in its place
        (on an object store, files without a manifest are a publish that died; the next takes over)."""
        final = self.version_path(model, version)
        return bool(self.fs.isfile(f"{final}/{MANIFEST}") or (self.is_local and self.fs.exists(final)))

    def manifest(self, model: str, version: str) -> Manifest:
        """The parsed manifest; raises :class:`VersionNotFound` or :class:`IncompleteVersion`."""
        return self.read_manifest(model, version)[0]

    def read_manifest(self, model: str, version: str, pin: str | None = None) -> tuple[Manifest, bytes]:
        """The parsed manifest and its exact bytes (whose sha256 keys a node's verified copy).
        With ``pin``, a manifest whose bytes hash to anything else is refused
        (:class:`TamperedVersion`): the version was replaced after it was checked.

        The filesystem's listing cache is dropped first: s3fs keeps directory listings for the
        life of its (shared) instance, and a stale listing would hide a deleted or added file.
        """
        self.fs.invalidate_cache()
        path = self.version_path(model, version)
        ids = {"model": model, "version": version}
        if not self.fs.isdir(path):
            raise VersionNotFound(f"{model}@{version} not found in {self.root}", **ids)
        try:
            raw = bytes(self.fs.cat_file(f"{path}/{MANIFEST}"))
        except FileNotFoundError:
            raise IncompleteVersion(f"{model}@{version} has no {MANIFEST} (an interrupted publish?)", **ids) from None
        try:
            manifest = Manifest.model_validate_json(raw)
        except ValidationError as exc:
            raise IncompleteVersion(f"{model}@{version}: invalid {MANIFEST}: {exc}", **ids) from exc
        if (manifest.model, manifest.version) != (model, version):
            raise TamperedVersion(
                f"{model}@{version}: {MANIFEST} describes {manifest.model}@{manifest.version}",
                **ids,
            )
        if pin is not None and (digest := manifest_sha256(raw)) != pin:
            raise TamperedVersion(
                f"{model}@{version}: {MANIFEST} has sha256 {digest[:16]}..., not the {pin[:16]}... pinned for this "
                "version (it was replaced after it was checked)",
                **ids,
            )
        return manifest, raw

    def _remote_files(self, path: str) -> Iterator[str]:
        for full in self.fs.find(path):
            if not full.endswith("/"):  # an object store's folder marker
                yield full[len(path) :].lstrip("/")

    def verify(self, model: str, version: str, gate: Gate | None = None) -> Manifest:
        """Re-hash every file against the manifest, then apply the eval gate."""
        return self.verify_pinned(model, version, gate)[0]

    def verify_pinned(self, model: str, version: str, gate: Gate | None = None) -> tuple[Manifest, str]:
        """:meth:`verify`, with the sha256 of the manifest's bytes that were checked: the pin that
        replicas of this version then hold the store's manifest to (``ModelVersion.manifest_sha256``)."""
        manifest, raw = self.read_manifest(model, version)
        path = self.version_path(model, version)
        check_files(manifest, set(self._remote_files(path)), self._remote_hash(path))
        if gate is not None:
            gate.check(manifest)
        return manifest, manifest_sha256(raw)

    def _remote_hash(self, base: str) -> Callable[[str], str]:
        def digest(rel: str) -> str:
            h = hashlib.sha256()
            with self.fs.open(f"{base}/{rel}", "rb") as fh:
                while chunk := fh.read(_CHUNK):
                    h.update(chunk)
            return h.hexdigest()

        return digest

    # -- writing -------------------------------------------------------------------------------

    def publish(self, local_dir: str | Path, fields: Mapping[str, Any]) -> Manifest:
        """Publish the files of ``local_dir`` as ``fields["model"]@fields["version"]``.

        ``fields`` are the manifest fields other than ``files`` and ``created_at``, which are filled
        in here. Files go to ``<model>/.tmp-<version>-<hex>/`` with the manifest last, then the
        directory is renamed into place (atomic on a local disk; on object stores, files are moved
        one by one with the manifest last, so a version is never listed before it is whole).
        """
        model, version = str(fields["model"]), str(fields["version"])
        ids = {"model": model, "version": version}
        final = self.version_path(model, version)
        if self.exists(model, version):
            where = self.uri(model, version)
            raise VersionExists(
                f"{model}@{version} already exists at {where}; versions are immutable, pick a new version name",
                **ids,
            )
        files = hash_tree(local_dir)
        if fields.get("architecture") is None:
            fields = {**fields, "architecture": architecture_of(local_dir)}
        sizes = {rel: (Path(local_dir) / rel).stat().st_size for rel in files}
        created = datetime.now(UTC).replace(microsecond=0)
        manifest = Manifest.model_validate({**fields, "files": files, "sizes": sizes, "created_at": created})
        tmp = self._join(model, f"{TMP_PREFIX}{version}-{secrets.token_hex(4)}")
        try:
            for rel in files:
                self.fs.makedirs(f"{tmp}/{rel}".rsplit("/", 1)[0], exist_ok=True)
                self.fs.put_file(str(Path(local_dir) / rel), f"{tmp}/{rel}")
            body = json.dumps(manifest.model_dump(mode="json"), indent=2) + "\n"
            self.fs.pipe_file(f"{tmp}/{MANIFEST}", body.encode())
            self._rename_into_place(tmp, final, [*files, MANIFEST], ids)
        finally:
            if self.fs.exists(tmp):
                self.fs.rm(tmp, recursive=True)
        return manifest

    def _rename_into_place(self, tmp: str, final: str, order: list[str], ids: dict[str, str]) -> None:
        if self.is_local:
            try:
                os.rename(tmp, final)  # atomic; fails if a non-empty `final` appeared meanwhile
            except OSError as exc:
                label = f"{ids['model']}@{ids['version']}"
                raise VersionExists(f"{label} appeared while publishing: {exc}", **ids) from exc
            return
        why = move_into_place(self.fs, tmp, final, order, f"{ids['model']}@{ids['version']}")
        if why is not None:
            raise VersionExists(why, **ids)
