"""Node-local verified cache: an engine loads only files that match their version's manifest.

A replica resolves its version directory here before it starts vLLM. Hashing every file of a
large model at every start would cost minutes, so the full check is paid once per node and
manifest: after it, a *marker* records the manifest's sha256 and each file's size, mtime, inode
and change time as stat'ed before the hashing (a file that changes while it is hashed is refused), and a later start
only compares those and the manifest's sizes (a ``stat`` per file). The layout under the cache
directory (``$RAYSTACK_CACHE_DIR``, default ``~/.cache/raystack/checkpoints``)::

    <model>/<version>/<src>-<msha>/                a remote version's verified copy
    <model>/<version>/<src>-<msha>.verified.json   the marker (for a local store: of the files in place)
    <model>/<version>/<src>-<msha>.lock            flock'd while one process fetches or hashes
    <model>/<version>/.tmp-<src>-<msha>-<hex>/     a download in progress (renamed when verified)

``<src>`` is a hash of the version's URI and ``<msha>`` of the manifest's bytes, so a changed
manifest (same version name, other bytes) never matches an old marker: it is verified anew.

- **Local store**: files are hashed in place (no copy); the marker says they were whole.
- **Remote store** (``s3://``, ``memory://``...): the listing is checked against the manifest first
  (a partial version, or an object key that is not a plain path inside the version such as
  ``v1/../../x``, is refused before any download), the listed files are downloaded into a
  temporary directory, hashed, and the directory is renamed into place. Temporary directories
  that a process killed mid-fetch left behind are removed by the next holder of the lock.

Replicas of one version on one node start together: the first takes the lock and fetches, the
others wait on it and then find the marker, so the download and the hashing happen once. A cached
copy whose files no longer match the marker (any write, ``utime`` or replacement changes the change
time or the inode) is fetched again; a local store's files are hashed again, and refused if they
differ. A local store's files are loaded in place: a file rewritten after the check and before
vLLM has read it is not seen (copy the version into a remote store, or keep writers off the
serving store).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from serving import registry
from serving.manifest import MANIFEST, Manifest, check_file_name, manifest_sha256
from serving.registry import TMP_PREFIX, CheckpointStore, TamperedVersion, check_files

__all__ = ["CACHE_ENV", "Resolved", "VerifiedCache", "default_cache_dir", "split_version_uri"]

CACHE_ENV = "RAYSTACK_CACHE_DIR"
MARKER_FORMAT = 2

logger = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """``$RAYSTACK_CACHE_DIR``, else ``~/.cache/raystack/checkpoints``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "raystack" / "checkpoints"


def split_version_uri(uri: str) -> tuple[str, str, str]:
    """``(store root, model, version)`` of a version directory laid out as ``<root>/<model>/<version>``
    (also when the stack config names the directory with a custom ``path``)."""
    parts = uri.rstrip("/").rsplit("/", 2)
    if len(parts) != 3 or not parts[0] or parts[0].endswith(":/"):
        raise ValueError(f"{uri!r} is not a version directory <store root>/<model>/<version>")
    root, model, version = parts
    return root, registry.check_name("model", model), registry.check_name("version", version)


@dataclass(frozen=True)
class Resolved:
    """A verified local directory and what it took: ``cached`` (the stats only),
    ``verified`` (a local store hashed in place) or ``downloaded`` (fetched and hashed)."""

    path: str
    manifest: Manifest
    manifest_sha256: str
    action: Literal["cached", "verified", "downloaded"]
    hashed_files: int
    seconds: float


def _tree(directory: Path) -> dict[str, os.stat_result]:
    """``{relative posix path: stat}`` of every file under ``directory`` but the manifest."""
    out: dict[str, os.stat_result] = {}
    for dirpath, _dirs, names in os.walk(directory):
        for name in names:
            full = Path(dirpath) / name
            rel = full.relative_to(directory).as_posix()
            if rel != MANIFEST:
                out[rel] = full.stat()
    return out


def _same_file(a: os.stat_result | None, b: os.stat_result | None) -> bool:
    """Whether two stats show the same, unchanged file (a rewrite or a replacement changes one)."""
    if a is None or b is None:
        return a is b
    return (a.st_size, a.st_mtime_ns, a.st_ino, a.st_ctime_ns) == (b.st_size, b.st_mtime_ns, b.st_ino, b.st_ctime_ns)


def _stamp(st: os.stat_result) -> dict[str, int]:
    """What the marker keeps of a verified file's stat. The change time is set by the kernel on
    every write, rename or ``utime`` (no caller can put it back), and a replaced file has another
    inode, so a rewrite that restores the size and mtime still shows."""
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino, "ctime_ns": st.st_ctime_ns}


def _refuse(manifest: Manifest, message: str) -> TamperedVersion:
    label, ids = f"{manifest.model}@{manifest.version}", {"model": manifest.model, "version": manifest.version}
    return TamperedVersion(f"{label}: {message}", **ids)


def _check_sizes(manifest: Manifest, sizes: dict[str, int]) -> None:
    """Refuse a version whose files miss or differ in size from the manifest's ``sizes`` (when it
    records them): a truncated or partial upload fails here, before anything is hashed."""
    for rel, want in sorted(manifest.sizes.items()):
        got = sizes.get(rel)
        if got is None:
            raise _refuse(manifest, f"file {rel} is listed in the manifest but missing")
        if got != want:
            raise _refuse(manifest, f"file {rel} is {got} bytes, the manifest says {want}")


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path``: processes (and threads with their own descriptor) of
    this node take turns; the kernel drops it if the holder dies."""
    with open(path, "a+b") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


class VerifiedCache:
    """The node-local cache at ``cache_dir`` (default :func:`default_cache_dir`)."""

    def __init__(self, cache_dir: str | Path | None = None) -> None:
        self.dir = Path(cache_dir) if cache_dir else default_cache_dir()

    def resolve_uri(self, uri: str, pin: str | None = None) -> Resolved:
        """:meth:`resolve` for a version directory URI (``<root>/<model>/<version>``)."""
        root, model, version = split_version_uri(uri)
        return self.resolve(CheckpointStore(root), model, version, pin)

    def resolve(self, store: CheckpointStore, model: str, version: str, pin: str | None = None) -> Resolved:
        """A local directory holding exactly the files of ``model@version``'s manifest.

        With ``pin`` (the sha256 of the manifest a promotion's gate checked, or the stack config's
        ``manifest_sha256``), a manifest with other bytes is refused before any file is read: a
        version replaced in the store, files and manifest together, is not served.

        Raises :class:`~serving.registry.RegistryError` (``TamperedVersion`` naming the file or the
        manifest, ``IncompleteVersion``, ``VersionNotFound``) and never returns a path it has not
        verified.
        """
        started = time.monotonic()
        manifest, raw = store.read_manifest(model, version, pin)
        digest = manifest_sha256(raw)
        source = store.uri(model, version)
        slot = self.dir / model / version / f"{hashlib.sha256(source.encode()).hexdigest()[:12]}-{digest[:16]}"
        marker = slot.parent / f"{slot.name}.verified.json"
        target = Path(store.version_path(model, version)) if store.is_local else slot

        def done(action: Literal["cached", "verified", "downloaded"], hashed: int) -> Resolved:
            return Resolved(str(target), manifest, digest, action, hashed, time.monotonic() - started)

        if self._cheap_ok(marker, target, manifest, digest):
            return done("cached", 0)
        slot.parent.mkdir(parents=True, exist_ok=True)
        with _locked(slot.parent / f"{slot.name}.lock"):
            if self._cheap_ok(marker, target, manifest, digest):  # another replica just did it
                return done("cached", 0)
            if store.is_local:
                stats = self._verify_dir(manifest, target)
                action: Literal["verified", "downloaded"] = "verified"
            else:
                stats = self._download(store, manifest, raw, slot)
                action = "downloaded"
            self._write_marker(marker, stats, manifest, digest, source)
        logger.info("%s@%s %s: %d files hashed from %s", model, version, action, len(manifest.files), source)
        return done(action, len(manifest.files))

    @staticmethod
    def _cheap_ok(marker: Path, target: Path, manifest: Manifest, digest: str) -> bool:
        """The marker is for this manifest and every file still has its recorded stat
        and the manifest's size (and no file was added or removed)."""
        try:
            data: dict[str, Any] = json.loads(marker.read_text())
        except (OSError, ValueError):
            return False
        if data.get("format") != MARKER_FORMAT or data.get("manifest_sha256") != digest:
            return False
        recorded: dict[str, dict[str, int]] = data.get("files", {})
        try:
            now = _tree(target)
        except OSError:
            return False
        if set(now) != set(recorded) or set(now) != set(manifest.files):
            logger.warning("%s: the files differ from the verified ones; checking again", target)
            return False
        for rel, st in now.items():
            if _stamp(st) != recorded[rel]:
                logger.warning("%s: file %s changed since it was verified; checking again", target, rel)
                return False
            if st.st_size != manifest.sizes.get(rel, st.st_size):
                logger.warning("%s: file %s differs in size from the manifest; checking again", target, rel)
                return False
        return True

    @staticmethod
    def _verify_dir(manifest: Manifest, directory: Path) -> dict[str, os.stat_result]:
        """Hash ``directory``'s files against the manifest; returns their stats from before the
        hashing, which the marker records, so a file that changed meanwhile is refused here."""
        stats = _tree(directory)
        _check_sizes(manifest, {rel: st.st_size for rel, st in stats.items()})
        check_files(manifest, set(stats), lambda rel: registry.sha256_file(directory / rel))
        after = _tree(directory)
        changed = sorted(rel for rel in stats.keys() | after.keys() if not _same_file(stats.get(rel), after.get(rel)))
        if changed:
            raise _refuse(manifest, f"file {changed[0]} changed while it was hashed")
        return stats

    @staticmethod
    def _listing(store: CheckpointStore, manifest: Manifest, src: str) -> dict[str, int]:
        """``{relative path: size}`` of the remote version directory ``src`` but the manifest;
        refused if a key is not a plain relative path (object stores accept ``v1/../../x``)."""
        listing: dict[str, int] = {}
        for name, info in store.fs.find(src, detail=True).items():
            rel = str(name)[len(src) :].removeprefix("/")
            if rel == MANIFEST or not rel or str(name).endswith("/"):  # an object store's folder marker
                continue
            try:
                check_file_name(rel)
            except ValueError as exc:
                raise _refuse(manifest, f"the store lists {exc}") from None
            listing[rel] = int(info.get("size") or 0)
        return listing

    @staticmethod
    def _download(store: CheckpointStore, manifest: Manifest, raw: bytes, slot: Path) -> dict[str, os.stat_result]:
        """Fetch, hash and rename the version into ``slot``; returns the stats of its files. The
        caller holds the slot's lock, so a ``.tmp-<slot>-*`` directory here is a dead holder's."""
        for stale in slot.parent.glob(f"{TMP_PREFIX}{slot.name}-*"):
            logger.warning("%s: removing a partial download left by a process that died", stale)
            shutil.rmtree(stale, ignore_errors=True)
        src = store.version_path(manifest.model, manifest.version)
        listing = VerifiedCache._listing(store, manifest, src)
        _check_sizes(manifest, listing)
        check_files(manifest, set(listing), lambda rel: manifest.files[rel])  # presence only, yet
        tmp = slot.parent / f"{TMP_PREFIX}{slot.name}-{secrets.token_hex(4)}"
        root = tmp.resolve()
        try:
            for rel in manifest.files:
                dest = tmp / rel
                if not dest.resolve().is_relative_to(root):  # the names were checked: a second guard
                    raise _refuse(manifest, f"file {rel} would be written outside {tmp}")
                dest.parent.mkdir(parents=True, exist_ok=True)
                store.fs.get_file(f"{src}/{rel}", str(dest))
            (tmp / MANIFEST).write_bytes(raw)  # the bytes whose hash keys this copy
            stats = VerifiedCache._verify_dir(manifest, tmp)
            if slot.exists():  # a copy that failed the cheap check: replaced
                shutil.rmtree(slot)
            os.rename(tmp, slot)  # the files keep their stat (inode, times)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return stats

    @staticmethod
    def _write_marker(
        marker: Path, stats: dict[str, os.stat_result], manifest: Manifest, digest: str, source: str
    ) -> None:
        files = {rel: _stamp(st) for rel, st in stats.items()}
        body = {
            "format": MARKER_FORMAT,
            "model": manifest.model,
            "version": manifest.version,
            "source": source,
            "manifest_sha256": digest,
            "verified_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "files": files,
        }
        tmp = marker.with_name(f"{marker.name}.{secrets.token_hex(4)}")
        tmp.write_text(json.dumps(body, indent=2))
        os.replace(tmp, marker)
