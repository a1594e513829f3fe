"""Which base version each LoRA adapter version runs on, for the Serve config and the promotion
controller.

An adapter (a model with ``base``) is served by its base's replicas, and each of its versions on
the base version its manifest says it was trained on (``base.ref``, resolved by
:func:`base_version_for`, and held to ``base.manifest_sha256`` by :func:`check_base_manifest`). So
the Serve application that answers an adapter version is that base version's, a base version that
a configured adapter version runs on must stay deployed (at weight 0 if the base itself moved on),
and an adapter version whose base version is not served cannot be promoted.

A manifest that is not there (an adapter version not published yet) and one that cannot be read
now (a store out of reach) are told apart: the first runs on no base version so far, the second
raises :class:`ManifestUnreadable`, so that no base version is dropped or deployed on a guess.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import fsspec
from pydantic import ValidationError

from serving.config import ConfigError, ModelConfig, ModelVersion, StackConfig
from serving.manifest import MANIFEST, BaseRef, Manifest, manifest_sha256
from serving.redact import redact_uri
from serving.registry import CheckpointStore, RegistryError, manifest_at

__all__ = [
    "AdapterBases",
    "ManifestUnreadable",
    "Needed",
    "app_name",
    "base_version_for",
    "check_base_manifest",
    "check_no_manifest",
    "manifest_bytes",
    "trained_on",
]

log = logging.getLogger("raystack.promotion")


def app_name(model: str, version: str) -> str:
    """The Serve application of a (base) model version."""
    return f"{model}--{version}".replace(".", "-").replace("_", "-").lower()


class ManifestUnreadable(OSError):
    """A version's manifest may be there but cannot be read now (a store out of reach)."""


def manifest_bytes(path: str) -> bytes | None:
    """The bytes of the manifest of version folder ``path``; None when it has none;
    :class:`ManifestUnreadable` when the read fails otherwise."""
    try:
        fs, p = fsspec.core.url_to_fs(path)
        return bytes(fs.cat_file(f"{p.rstrip('/')}/{MANIFEST}"))
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 - a network, permission or timeout error: not "no manifest"
        raise ManifestUnreadable(f"the manifest at {redact_uri(path)} cannot be read: {redact_uri(str(exc))}") from exc


def check_no_manifest(path: str) -> None:
    """After a read of ``path``'s manifest found none (``manifest_at`` gave None, the store said
    not found): return when the folder holds no valid manifest (none published there, or an
    invalid one); else :class:`ManifestUnreadable`, as the read failed rather than found nothing."""
    raw = manifest_bytes(path)
    if raw is None:
        return
    try:
        Manifest.model_validate_json(raw)
    except ValidationError:
        return
    raise ManifestUnreadable(f"the manifest at {redact_uri(path)} is there, but a read of it failed")


def _held_ref(raw: bytes) -> str:
    try:
        held = Manifest.model_validate_json(raw)
    except ValidationError:
        return "no valid manifest"
    return f"{held.model}@{held.version}"


def base_version_for(
    cfg: StackConfig,
    b: ModelConfig,
    ref: str,
    base: Path | None = None,
    sha: str | None = None,
    read: Callable[[str], bytes | None] = manifest_bytes,
) -> str | None:
    """The version of base model ``b`` that holds the checkpoint ``ref`` (``model@version``: what an
    adapter's manifest says it was trained on; ``sha``: the sha256 of that checkpoint's manifest,
    where it records one). When ``b`` is ``model``: ``version``, served or not. Else a version of
    ``b`` served from that very checkpoint (a ``path:`` to it), for example the same weights deployed
    under another name with another router: its manifest's bytes hash to ``sha`` (without one:
    its manifest is ``ref``'s); None when ``b`` serves none. :class:`ManifestUnreadable` when a
    manifest of ``b`` cannot be read."""
    model, _, version = ref.partition("@")
    if not model or not version:
        return None
    if model == b.name:
        return version
    for bv in b.versions:
        raw = read(cfg.version_path(b, bv, base))
        if raw is not None and (manifest_sha256(raw) == sha if sha else _held_ref(raw) == ref):
            return bv.version
    return None


def check_base_manifest(
    cfg: StackConfig,
    where: str,
    b: ModelConfig,
    bv: ModelVersion,
    trained: BaseRef,
    base: Path | None = None,
    read: Callable[[str], bytes | None] = manifest_bytes,
) -> None:
    """ConfigError (naming ``where``, the adapter version) unless base version ``b@bv`` serves the
    checkpoint the adapter was trained on: where the adapter's manifest records
    ``base.manifest_sha256``, the bytes of ``b@bv``'s manifest hash to it; and its manifest is
    ``trained.ref``'s (``model@version``), unless ``bv`` is a ``path:`` (a folder outside the
    store, whose manifest may name it otherwise) and the hashes were compared."""
    path = cfg.version_path(b, bv, base)
    raw = read(path)
    recorded = trained.manifest_sha256
    served = f"models[{b.name}].versions[{bv.version}]"
    if raw is None:
        if recorded:
            raise ConfigError(
                f"{where}: trained on {trained.ref} (manifest sha256 {recorded}), but {served} has no manifest "
                f"at {redact_uri(path)} to compare"
            )
        return
    digest, held = manifest_sha256(raw), _held_ref(raw)
    named = held == trained.ref or (bv.path is not None and recorded is not None)
    if not named or (recorded and digest != recorded):
        raise ConfigError(
            f"{where}: trained on {trained.ref} (manifest sha256 {recorded or 'not recorded'}), but {served} "
            f"serves {held} (manifest sha256 {digest})"
        )


def trained_on(
    cfg: StackConfig,
    m: ModelConfig,
    v: ModelVersion,
    b: ModelConfig,
    manifest: Manifest,
    base: Path | None,
    read: Callable[[str], bytes | None] = manifest_bytes,
) -> str:
    """The base version adapter version ``m@v`` (its ``manifest`` read) runs on: see
    :func:`serving.control.serve_config.adapter_bases`; ConfigError naming the field otherwise."""
    where = f"models[{m.name}].versions[{v.version}]"
    trained = manifest.base if manifest.base and manifest.base.source == "store" else None
    ref = trained.ref if trained else ""
    version = None
    if trained is not None and manifest.adapter is not None:
        version = base_version_for(cfg, b, ref, base, trained.manifest_sha256, read)
    if trained is None or manifest.adapter is None or version is None:
        sha = f", manifest sha256 {trained.manifest_sha256}" if trained and trained.manifest_sha256 else ""
        raise ConfigError(f"{where}: not a LoRA adapter of {b.name!r} (its manifest's base is {ref or 'none'}{sha})")
    served = b.version(version)
    if served is None:
        versions = ", ".join(x.version for x in b.versions)
        raise ConfigError(f"{where}: trained on {ref}, which is not served ({b.name} serves {versions})")
    check_base_manifest(cfg, where, b, served, trained, base, read)
    slots = cfg.lora_slots(b)
    if slots is not None and manifest.adapter.rank > slots.max_lora_rank:
        raise ConfigError(
            f"{where}: rank {manifest.adapter.rank} exceeds models[{b.name}].lora.max_lora_rank {slots.max_lora_rank}"
        )
    return str(version)


class Needed(NamedTuple):
    """What the configured adapter versions need of their bases."""

    versions: dict[str, set[str]]  # base model -> the versions its adapter versions run on
    unknown: dict[str, str]  # base model -> why the base version of one of its adapter versions is not known now


class AdapterBases:
    """The base versions of adapter versions in the stack config ``seed`` (as written), read from
    their manifests once each: at the version's configured path (relative to ``base``, the config
    file's folder), else in ``store``."""

    def __init__(self, seed: StackConfig, store: CheckpointStore, base: Path | None = None) -> None:
        self.seed, self.store, self.base = seed, store, base
        self._trained_on: dict[tuple[str, str], str] = {}  # (adapter, version) -> base version

    def _manifest(self, adapter: ModelConfig, version: str) -> Manifest:
        """``adapter@version``'s manifest; RegistryError when it is not published, OSError
        (:class:`ManifestUnreadable`) when it cannot be read now."""
        configured = self.seed.model(adapter.name).version(version) or ModelVersion(version=version)
        path = self.seed.version_path(adapter, configured, self.base)
        manifest = manifest_at(path)
        if manifest is None:
            try:
                manifest = self.store.manifest(adapter.name, version)
            except RegistryError:
                check_no_manifest(path)  # a local store out of reach looks empty to the store's isdir
                raise
        if manifest is None:
            raise ManifestUnreadable(f"{adapter.name}@{version}: its manifest could not be read")
        return manifest

    def version_for(self, adapter: ModelConfig, version: str) -> str:
        """The base version ``adapter@version`` runs on; RegistryError when it is not published or
        its manifest names no version of its base, OSError when a manifest cannot be read now."""
        key = (adapter.name, version)
        if key not in self._trained_on:
            manifest = self._manifest(adapter, version)
            ref = manifest.base.ref if manifest.base else ""
            sha = manifest.base.manifest_sha256 if manifest.base else None
            found = base_version_for(self.seed, self.seed.model(adapter.base or ""), ref, self.base, sha)
            if found is None:
                raise RegistryError(f"{adapter.name}@{version} is not an adapter of {adapter.base} (base {ref!r})")
            self._trained_on[key] = found
        return self._trained_on[key]

    def app(self, model: str, version: str) -> str:
        """The Serve application that answers ``model@version``."""
        m = self.seed.model(model)
        if m.base is None:
            return app_name(model, version)
        return app_name(m.base, self.version_for(m, version))

    def needed(self, cfg: StackConfig) -> Needed:
        """Base model -> the versions its configured adapter versions run on (weight 0 included: the
        base's replicas register every configured version, and the config is refused without it).
        An adapter version not published yet runs on none; one whose manifest cannot be read now
        makes its base's versions ``unknown`` (any of them may be the one it runs on)."""
        versions: dict[str, set[str]] = {}
        unknown: dict[str, str] = {}
        for a in cfg.models:
            for v in a.versions if a.base else ():
                try:
                    found = self.version_for(a, v.version)
                except RegistryError as exc:  # not published yet: it keeps no base version here
                    log.warning("%s@%s: its base version is not known (%s)", a.name, v.version, exc)
                    continue
                except Exception as exc:  # noqa: BLE001 - the store cannot be read now (OSError, timeout...)
                    log.warning("%s@%s: its manifest cannot be read now (%s)", a.name, v.version, exc)
                    unknown.setdefault(a.base or "", f"{a.name}@{v.version}'s manifest cannot be read: {exc}")
                    continue
                versions.setdefault(a.base or "", set()).add(found)
        return Needed(versions, unknown)

    def keep_needed(self, cfg: StackConfig, model: str, weights: dict[str, int]) -> dict[str, int]:
        """``weights`` plus, at 0, each version of ``model`` that an adapter version configured in
        ``cfg`` (what serves now) runs on, in the order ``cfg`` serves them; every version ``cfg``
        serves when that cannot be told now (a manifest the store cannot read)."""
        needed = self.needed(cfg)
        versions = cfg.model(model).versions
        keep = needed.versions.get(model, set())
        if model in needed.unknown:
            keep = {v.version for v in versions}
            log.warning("%s: every served version kept (at 0 %% if dropped): %s", model, needed.unknown[model])
        order = {v.version: i for i, v in enumerate(versions)}
        return weights | {v: 0 for v in sorted(keep - set(weights), key=lambda v: order.get(v, len(order)))}

    def check(self, cfg: StackConfig, adapter: ModelConfig, version: str) -> None:
        """RegistryError unless the base version ``adapter@version`` runs on is served in ``cfg``."""
        base = cfg.model(adapter.base or "")
        trained_on = self.version_for(adapter, version)
        if base.version(trained_on) is None:
            served = ", ".join(v.version for v in base.versions)
            why = f"{adapter.name}@{version} was trained on {adapter.base}@{trained_on}, which is not served ({served})"
            raise RegistryError(why)
