"""Resolve ``--base`` to a local Hugging Face folder and the :class:`BaseRef` the manifest records.

Forms, tried in this order (the first that applies wins)::

    init:<family>-<size>      freshly initialised by training.families (tokenizer learnt on the data)
    <scheme>://...            an fsspec URI of a folder, downloaded to a temporary directory (recorded
                              without user info or query string: serving.redact.redact_uri)
    an existing local path    a Hugging Face folder (config.json + weights + tokenizer)
    <model>@<version>         a version of the checkpoint store, hash-verified first
    hub:<id> or <org>/<name>  a Hugging Face hub id (snapshot_download)

Why an existing path wins over a hub id: ``org/name`` is also a valid relative path, and a user
who has such a folder means it; a hub id that happens to exist as a folder can be written
``hub:org/name``. ``@`` cannot occur in a hub id, so ``model@version`` is unambiguous.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import fsspec

from serving.manifest import BaseRef
from serving.node_cache import VerifiedCache
from serving.redact import redact_uri
from serving.registry import CheckpointStore

__all__ = ["BaseError", "ResolvedBase", "is_store_ref", "parameter_count", "resolve_base"]

INIT: Final = "init:"
HUB: Final = "hub:"
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_STORE_REF = re.compile(r"^(?P<model>[A-Za-z0-9][A-Za-z0-9._-]*)@(?P<version>[A-Za-z0-9][A-Za-z0-9._-]*)$")
_PICKLED: Final = (".bin", ".pt", ".pth")
_HEADER_LIMIT: Final = 100 << 20  # a safetensors header is a few MB of JSON at most


class BaseError(ValueError):
    """The base cannot be found, fetched or built."""


@dataclass(frozen=True, slots=True)
class ResolvedBase:
    """A local folder with the base's files and how it was obtained."""

    directory: str
    ref: BaseRef

    @property
    def is_init(self) -> bool:
        return self.ref.source == "init"


def is_store_ref(ref: str) -> bool:
    """Whether ``ref`` names a version of the checkpoint store (``model@version``)."""
    return _STORE_REF.match(ref) is not None and not Path(ref).expanduser().exists()


def _check_folder(directory: str, label: str) -> str:
    if not (Path(directory) / "config.json").is_file():
        raise BaseError(f"{label}: {directory} has no config.json; is it a Hugging Face model folder?")
    return directory


def _from_init(ref: str, cache_dir: Path, corpus: Callable[[], Iterable[Any]], key: str, seed: int) -> ResolvedBase:
    """Build (once per ref, data and seed: the build is deterministic) a fresh base."""
    from training import families, tokenizer
    from training.families import build_base, parse_init_ref

    try:
        parse_init_ref(ref)
    except ValueError as exc:
        raise BaseError(str(exc)) from None
    # the family code (architecture sizes, template, tokenizer) is part of the key: a changed
    # template or size must not reuse a base built by older code
    code = hashlib.sha256(b"".join(Path(m.__file__ or "").read_bytes() for m in (families, tokenizer))).hexdigest()
    digest = hashlib.sha256(f"{ref}|{key}|{seed}|{code}".encode()).hexdigest()[:16]
    target = cache_dir / "init" / f"{ref[len(INIT) :]}-{digest}"
    if not (target / "config.json").is_file():
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=_mkdir(target.parent)))
        build_base(tmp, ref, corpus(), seed)
        try:
            os.rename(tmp, target)
        except OSError:  # built meanwhile by another job with the same arguments
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return ResolvedBase(str(target), BaseRef(source="init", ref=ref))


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _from_uri(ref: str, workdir: Path) -> ResolvedBase:
    """Download the folder at ``ref``; the manifest and messages get it without credentials."""
    target, shown = workdir / "base", redact_uri(ref)
    try:
        fs, path = fsspec.core.url_to_fs(ref)
        if not fs.isdir(path):
            raise FileNotFoundError("no such folder")
        fs.get(path.rstrip("/") + "/", str(target), recursive=True)
    except Exception as exc:  # OSError, ImportError, an HTTP 403 (aiohttp's own type, quoting the URL)...
        raise BaseError(f"base {shown}: cannot download: {redact_uri(str(exc))}") from None
    return ResolvedBase(_check_folder(str(target), f"base {shown}"), BaseRef(source="uri", ref=shown))


def _from_store(ref: str, store: CheckpointStore) -> ResolvedBase:
    m = _STORE_REF.match(ref)
    assert m is not None
    model, version = m["model"], m["version"]
    # verified once per node, like a serving replica's version (VersionNotFound / TamperedVersion
    # name what is wrong); the manifest hash recorded is the one the files were checked against
    local = VerifiedCache().resolve(store, model, version)
    if local.manifest.adapter is not None:
        on = local.manifest.base.ref if local.manifest.base else "its base"
        raise BaseError(f"{ref} is a LoRA adapter of {on}, not a model: pass that base as --base")
    return ResolvedBase(local.path, BaseRef(source="store", ref=ref, manifest_sha256=local.manifest_sha256))


def _from_hub(repo_id: str) -> ResolvedBase:
    from huggingface_hub import snapshot_download

    try:
        directory = snapshot_download(repo_id)
    except Exception as exc:  # offline, unknown repo, gated repo: all end the job the same way
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False")
        hint = (
            "HF_HUB_OFFLINE is set and the model is not in the local hub cache"
            if offline
            else "no network access to the hub, or no such repository"
        )
        raise BaseError(
            f"base {repo_id!r} is not a local folder, a store version (model@version) or an "
            f"init: reference, and downloading it from the Hugging Face hub failed ({hint}): "
            f"{type(exc).__name__}: {exc}"
        ) from None
    return ResolvedBase(_check_folder(directory, f"hub:{repo_id}"), BaseRef(source="hub", ref=repo_id))


def resolve_base(
    ref: str,
    store: CheckpointStore,
    workdir: Path,
    cache_dir: Path,
    corpus: Callable[[], Iterable[str | Mapping[str, Any]]],
    corpus_key: str,
    seed: int = 0,
) -> ResolvedBase:
    """Resolve ``ref`` (see the module docstring). ``workdir`` receives downloads, ``cache_dir``
    keeps built ``init:`` bases; ``corpus`` (called only for ``init:``) yields the rows the new
    tokenizer is trained on, and ``corpus_key`` identifies them (the data's sha256)."""
    if ref.startswith(INIT):
        return _from_init(ref, cache_dir, corpus, corpus_key, seed)
    if ref.startswith(HUB):
        return _from_hub(ref[len(HUB) :])
    if "://" in ref:
        return _from_uri(ref, workdir)
    if Path(ref).expanduser().exists():
        directory = str(Path(ref).expanduser().resolve())
        return ResolvedBase(_check_folder(directory, f"base {ref}"), BaseRef(source="folder", ref=directory))
    if _STORE_REF.match(ref):
        return _from_store(ref, store)
    if _HUB_ID.match(ref):
        return _from_hub(ref)
    raise BaseError(f"base {ref!r}: not init:<family>-<size>, a URI, an existing folder, model@version or a hub id")


def parameter_count(directory: str) -> int | None:
    """The parameters of the weights in ``directory``, or ``None`` when its files do not tell.

    ``*.safetensors`` files are counted exactly from their headers (the shape of every tensor,
    whatever its dtype; no weights are read). Without them, pickled weights (``*.bin``, ``*.pt``,
    ``*.pth``) are counted from ``*.index.json``'s ``metadata.total_size``, or else their files'
    sizes, at 2 bytes a parameter (bf16 or fp16, as large checkpoints ship): an fp32 file counts
    double, which errs towards the smaller step of a larger base.
    """
    folder = Path(directory)
    tensors = sorted(folder.glob("*.safetensors"))
    if tensors:
        counts = [_safetensors_params(path) for path in tensors]
        return None if None in counts else sum(c for c in counts if c is not None)
    pickled = [p for p in folder.glob("*") if p.suffix in _PICKLED and p.is_file()]
    if not pickled:
        return None
    total = _index_total_size(folder) or sum(p.stat().st_size for p in pickled)
    return total // 2


def _safetensors_params(path: Path) -> int | None:
    """Elements of every tensor in a safetensors header: 8 bytes (little-endian length), then JSON."""
    try:
        with path.open("rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            if length > _HEADER_LIMIT:
                return None
            header = json.loads(fh.read(length))
        return sum(math.prod(int(n) for n in t["shape"]) for name, t in header.items() if name != "__metadata__")
    except (OSError, ValueError, struct.error, KeyError, TypeError, AttributeError):
        return None


def _index_total_size(folder: Path) -> int | None:
    for index in sorted(folder.glob("*.index.json")):
        try:
            size = json.loads(index.read_text()).get("metadata", {}).get("total_size")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(size, int) and size > 0:
            return size
    return None
