"""``serving import``: bring a model made elsewhere into the checkpoint store as a version.

The source is a local Hugging Face folder, an fsspec URI of one (``s3://``, ``gs://``...) or a hub
id (``org/name``). A remote source is downloaded into a temporary folder first; then the folder is
published like a trained version (:meth:`CheckpointStore.publish`: sha256 and size of every file,
``architecture`` from ``config.json``, the manifest last), with ``base`` saying where it came from
and no ``eval``. Hidden entries (``.git``, ``.cache``) are left out. A version that exists is
refused before anything is downloaded: versions are immutable. A URI is logged, recorded as
``base.ref`` and quoted in errors in :func:`serving.redact.redact_uri`'s form: no
``user:password@``, no query string (a presigned URL's signature, a SAS token).

A symlink in the folder is imported as the file it points to when that file is inside the folder,
or, for a Hugging Face cache snapshot (``<repo>/snapshots/<rev>/``, whose files link to
``<repo>/blobs/``), inside the repo's ``blobs``, or in any hub cache's ``models--*/blobs/`` (where a
``local_dir`` download's links point). A dangling symlink, a symlink to anything else
and a symlinked folder are refused, naming the link and where it points.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import fsspec
from fsspec.implementations.local import LocalFileSystem

from serving.manifest import Manifest
from serving.redact import redact_uri
from serving.registry import CheckpointStore, VersionExists, check_name

__all__ = ["ImportFailed", "import_model", "source_kind", "source_ref"]

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class ImportFailed(RuntimeError):
    """The source cannot be read or is not a Hugging Face model folder."""


def source_kind(source: str) -> Literal["folder", "uri", "hub"]:
    """``uri`` for anything with a protocol, ``folder`` for an existing directory, ``hub`` for an
    ``org/name`` that is not a directory here."""
    if "://" in source:
        return "uri"
    if Path(source).is_dir():
        return "folder"
    if _HUB_ID.fullmatch(source):
        return "hub"
    raise ImportFailed(f"{source}: no such folder, and not a URI or a hub id (org/name)")


def _visible(directory: Path) -> bool:
    return not any(part.startswith(".") for part in directory.parts)


def _link_roots(folder: Path) -> list[Path]:
    """Where the folder's symlinks may point: the folder, and the repo's ``blobs`` when the folder
    is a Hugging Face cache snapshot (``<repo>/snapshots/<rev>``)."""
    real = folder.resolve()
    blobs = real.parent.parent / "blobs"
    return [real, blobs] if real.parent.name == "snapshots" and blobs.is_dir() else [real]


def _hub_blob(target: Path) -> bool:
    """A file of a Hugging Face hub cache (``models--<org>--<name>/blobs/<sha>``), where the
    symlinks of ``snapshot_download(local_dir=...)`` folders point."""
    return target.parent.name == "blobs" and target.parent.parent.name.startswith("models--")


def _check_links(folder: Path) -> Path:
    """``folder``, once every visible symlink in it is one the import may follow."""
    roots = _link_roots(folder)
    for link in sorted(p for p in folder.rglob("*") if p.is_symlink() and _visible(p.relative_to(folder))):
        rel = link.relative_to(folder).as_posix()
        try:
            target = link.resolve(strict=True)
        except (OSError, RuntimeError):  # RuntimeError: a symlink loop
            raise ImportFailed(f"{folder}: {rel} is a dangling symlink (to {os.readlink(link)})") from None
        if target.is_dir():
            raise ImportFailed(f"{folder}: {rel} is a symlinked folder (to {target}); copy the folder in instead")
        if not any(target.is_relative_to(root) for root in roots) and not _hub_blob(target):
            raise ImportFailed(f"{folder}: {rel} points outside the folder, to {target}")
    return folder


def _stage(folder: Path, into: Path) -> Path:
    """``folder`` itself, or a copy without its hidden entries when it has any."""
    if all(_visible(p.relative_to(folder)) for p in folder.rglob("*")):
        return folder
    shutil.copytree(folder, into, ignore=shutil.ignore_patterns(".*"))
    return into


def _fetch_uri(uri: str, into: Path) -> Path:
    try:
        fs, path = fsspec.core.url_to_fs(uri)
        path = path.rstrip("/")
        if not fs.isdir(path):
            raise ImportFailed(f"{redact_uri(uri)}: no such folder")
        if isinstance(fs, LocalFileSystem):  # file://: its links are held to a folder's rules
            _check_links(Path(path))
        for full in fs.find(path):
            rel = full[len(path) :].lstrip("/")
            if rel and not full.endswith("/") and _visible(Path(rel)):  # not an object store's folder marker
                (into / rel).parent.mkdir(parents=True, exist_ok=True)
                fs.get_file(full, str(into / rel))
    except (OSError, ValueError, ImportError) as exc:  # the store's own errors may quote the URI
        reason = redact_uri(" ".join(str(exc).split()))
        raise ImportFailed(f"cannot download {redact_uri(uri)} ({type(exc).__name__}: {reason})") from None
    return into


def _fetch_hub(repo_id: str, into: Path) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, cache_dir=str(into)))
    except Exception as exc:  # noqa: BLE001 - offline, unknown repo, gated: all end the import
        reason = redact_uri(" ".join(str(exc).split()))  # one line: hub errors span several
        raise ImportFailed(
            f"cannot download {repo_id} from the Hugging Face hub ({type(exc).__name__}: {reason}); "
            "without hub access, download it where there is one and import the folder"
        ) from None


def import_model(
    source: str, store: CheckpointStore, model: str, version: str, log: Callable[[str], None] = print
) -> Manifest:
    """Publish ``source`` as ``model@version`` of ``store``; returns its manifest."""
    check_name("model", model), check_name("version", version)
    if store.exists(model, version):
        raise VersionExists(
            f"{model}@{version} already exists at {store.uri(model, version)}; pick a new version name",
            model=model,
            version=version,
        )
    kind = source_kind(source)
    ref = source_ref(source, kind)
    with tempfile.TemporaryDirectory(prefix="raystack-import-") as tmp:
        if kind == "folder":
            folder = _stage(_check_links(Path(source)), Path(tmp) / "staged")
        elif kind == "uri":
            log(f"downloading {ref} ...")
            folder = _fetch_uri(source, Path(tmp) / "staged")
        else:
            log(f"downloading {ref} from the Hugging Face hub ...")
            folder = _stage(_check_links(_fetch_hub(source, Path(tmp) / "hub")), Path(tmp) / "staged")
        if not (folder / "config.json").is_file():
            raise ImportFailed(f"{redact_uri(source)}: not a Hugging Face model folder (no config.json)")
        return store.publish(folder, {"model": model, "version": version, "base": {"source": kind, "ref": ref}})


def source_ref(source: str, kind: Literal["folder", "uri", "hub"]) -> str:
    """Where a version came from, as its manifest records it (``base.ref``) and the import's log
    lines and errors name it: a folder's absolute path, a URI without its user info and query
    string (:func:`serving.redact.redact_uri`), a hub id as it is."""
    return str(Path(source).resolve()) if kind == "folder" else redact_uri(source)
