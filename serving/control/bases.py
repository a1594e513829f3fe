"""Which base version each LoRA adapter version runs on, for the promotion controller.

An adapter (a model with ``base``) is served by its base's replicas, and each of its versions on
the base version its manifest says it was trained on (``base.ref``, resolved by
:func:`~serving.control.serve_config.base_version_for`). So the Serve application that answers an
adapter version is that base version's, a base version that a configured adapter version runs on
must stay deployed (at weight 0 if the base itself moved on), and an adapter version whose base
version is not served cannot be promoted.
"""

from __future__ import annotations

import logging
from pathlib import Path

from serving.config import ModelConfig, ModelVersion, StackConfig
from serving.control.serve_config import app_name, base_version_for
from serving.registry import CheckpointStore, RegistryError, manifest_at

__all__ = ["AdapterBases"]

log = logging.getLogger("raystack.promotion")


class AdapterBases:
    """The base versions of adapter versions in the stack config ``seed`` (as written), read from
    their manifests once each: at the version's configured path (relative to ``base``, the config
    file's folder), else in ``store``."""

    def __init__(self, seed: StackConfig, store: CheckpointStore, base: Path | None = None) -> None:
        self.seed, self.store, self.base = seed, store, base
        self._trained_on: dict[tuple[str, str], str] = {}  # (adapter, version) -> base version

    def version_for(self, adapter: ModelConfig, version: str) -> str:
        """The base version ``adapter@version`` runs on; RegistryError when its manifest names
        no version of its base (OSError when the store cannot be read)."""
        key = (adapter.name, version)
        if key not in self._trained_on:
            configured = self.seed.model(adapter.name).version(version) or ModelVersion(version=version)
            manifest = manifest_at(self.seed.version_path(adapter, configured, self.base))
            if manifest is None:
                manifest = self.store.manifest(adapter.name, version)
            ref = manifest.base.ref if manifest.base else ""
            found = base_version_for(self.seed, self.seed.model(adapter.base or ""), ref, self.base)
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

    def needed(self, cfg: StackConfig) -> dict[str, set[str]]:
        """Base model -> the versions its configured adapter versions run on (weight 0 included: the
        base's replicas register every configured version, and the config is refused without it)."""
        out: dict[str, set[str]] = {}
        for a in cfg.models:
            for v in a.versions if a.base else ():
                try:
                    found = self.version_for(a, v.version)
                except (RegistryError, OSError) as exc:  # not published yet, or the store unreadable now:
                    log.warning("%s@%s: its base version is not known (%s)", a.name, v.version, exc)
                    continue  # it keeps no base version here; the deploy of that config says what is missing
                out.setdefault(a.base or "", set()).add(found)
        return out

    def keep_needed(self, cfg: StackConfig, model: str, weights: dict[str, int]) -> dict[str, int]:
        """``weights`` plus, at 0, each version of ``model`` that an adapter version configured in
        ``cfg`` (what serves now) runs on, in the order ``cfg`` serves them."""
        needed = self.needed(cfg).get(model, set())
        order = {v.version: i for i, v in enumerate(cfg.model(model).versions)}
        return weights | {v: 0 for v in sorted(needed - set(weights), key=lambda v: order.get(v, len(order)))}

    def check(self, cfg: StackConfig, adapter: ModelConfig, version: str) -> None:
        """RegistryError unless the base version ``adapter@version`` runs on is served in ``cfg``."""
        base = cfg.model(adapter.base or "")
        trained_on = self.version_for(adapter, version)
        if base.version(trained_on) is None:
            served = ", ".join(v.version for v in base.versions)
            why = f"{adapter.name}@{version} was trained on {adapter.base}@{trained_on}, which is not served ({served})"
            raise RegistryError(why)
