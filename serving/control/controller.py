"""The promotion controller's decisions: one :meth:`Controller.tick` reads the store, advances each
model's promotion by at most one step (deploying, stepping, finishing: serving.control.canary), and
records every step before it applies it.

Every applied config is built from the CURRENT record of live versions (``live.json``) over the
stack config, never from a snapshot taken when the promotion started, so promotions of different
models never undo each other. One promotion per model at a time. A step keeps the split that served
before the promotion (its versions share what the new one does not get), and a rollback restores
that split. A step whose config cannot be built (checked as a deploy builds it, manifests read) is
never recorded: the promotion is refused (deploy) or rolled back instead.

Record, then ``live.json``, then apply: a step is saved in the promotion's record marked
``live_pending``, written into ``live.json``, and the mark cleared. Each poll first writes the last
weighted step of a record still marked into ``live.json`` (a write that failed, or a controller that
died in between), so the record and ``live.json`` end up agreeing whatever failed. A failed apply
is retried every poll until one succeeds.

Restart rule: a controller that starts and finds an active promotion resumes it. Its step was
recorded before it was applied, so the first thing the new controller does is apply the record again
(a no-op if it already serves); a ``stepping`` promotion restarts its step's watch window from that
moment (the old window's scrape baseline may predate a metrics reset), ``deploying`` waits for the
app again and ``finishing`` completes.

Adapters: a LoRA adapter (a model with ``base``) is promoted like any model; its versions run on
the base versions their manifests name, so "its app" is that base version's. A base version that
a configured adapter version (any weight) runs on is never removed: promoting the base leaves it
at weight 0, serving only those adapters, and it is removed once no configured adapter version
needs it (their retrained versions on the new base were promoted). Every step, rollback and ``serving
rollback`` keeps such versions at weight 0. An adapter version not published yet runs on no base
version; one whose manifest cannot be read (a store out of reach) could run on any: while it cannot
be read, no version of its base is removed, a step keeps every version its base serves (at 0 if it
drops one), and an apply (which reads the manifests) fails and is retried at the next poll, leaving
what served before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from serving.config import ConfigError, ModelConfig, ModelVersion, PromotionPolicy, StackConfig
from serving.control.bases import AdapterBases
from serving.control.canary import Applier, Prober, PromotionSteps, _decision
from serving.control.serve_config import build_serve_config
from serving.lease import LockLost, StoreLock
from serving.manifest import Manifest
from serving.record import ControlStore, LiveEntry, PromotionRecord, PromotionRequest, StepRecord, pin_of
from serving.registry import CheckpointStore, RegistryError, _natural_key

__all__ = ["Applier", "Controller", "Prober", "policy_for", "with_live"]

log = logging.getLogger("raystack.promotion")


def with_live(cfg: StackConfig, live: Mapping[str, Sequence[LiveEntry]]) -> StackConfig:
    """The stack config with the recorded live versions and weights of each model applied, and the
    manifest pins the record holds (over the config's own)."""
    models = []
    for m in cfg.models:
        if m.name in live:
            known = {v.version: v for v in m.versions}
            versions = []
            for entry in live[m.name]:
                v, w, pin = entry[0], entry[1], pin_of(entry)
                fields: dict[str, Any] = {"weight": w} | ({"manifest_sha256": pin} if pin else {})
                versions.append(known[v].model_copy(update=fields) if v in known else ModelVersion(version=v, **fields))
            m = m.model_copy(update={"versions": versions})
        models.append(m.model_dump())
    # the recipes were checked on the config as written; the record may have dropped a base version one names
    return StackConfig.model_validate({**cfg.model_dump(), "models": models}, context={"live": True})


def policy_for(m: ModelConfig, overrides: dict[str, Any]) -> PromotionPolicy:
    """``m``'s promotion policy with a request's overrides; ValueError naming each wrong setting."""
    try:
        return PromotionPolicy.model_validate({**m.promotion.model_dump(), **overrides})
    except ValidationError as exc:
        wrong = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
        raise ValueError(f"invalid promotion settings: {'; '.join(wrong)}") from None


class Controller(PromotionSteps):
    """See the module docstring. ``seed`` is the stack config as written (YAML)."""

    def __init__(
        self,
        seed: StackConfig,
        store: CheckpointStore,
        control: ControlStore,
        lock: StoreLock,
        applier: Applier,
        prober: Prober,
        clock: Callable[[], float] = time.time,
        observe: Callable[[str, dict[str, int], str], None] = lambda model, weights, phase: None,
        base: Path | None = None,
    ) -> None:
        self.seed, self.store, self.control, self.lock = seed, store, control, lock
        self.applier, self.prober, self.clock, self.observe = applier, prober, clock, observe
        self._resumed: set[str] = set()
        self._active = False
        self._dirty = False  # what serves may differ from live.json: an apply is due
        self.base = base  # the config file's folder: relative version paths start there
        self.bases = AdapterBases(seed, store, base)

    # -- the record -----------------------------------------------------------------------------

    def live(self) -> dict[str, Sequence[LiveEntry]]:
        recorded = {m: [v.entry() for v in vs] for m, vs in self.control.live().items()}
        return {m.name: recorded.get(m.name) or [(v.version, v.weight) for v in m.versions] for m in self.seed.models}

    def current(self) -> StackConfig:
        return with_live(self.seed, self.live())

    def _set(self, model: str, versions: Sequence[LiveEntry]) -> None:
        """Record, then apply the whole current config (every model as recorded now)."""
        self.lock.ensure(f"recording {model}'s live versions")
        self.control.set_live(model, versions)
        self._dirty = True
        self._apply()

    def _apply(self) -> None:
        """Apply the whole current config; a failure leaves it due, and the next poll tries again."""
        self.lock.ensure("applying the recorded config")
        try:
            self.applier.apply(self.current())
        except Exception as exc:
            self._dirty = True
            log.exception("applying the recorded config failed; trying again next poll: %s", exc)
        else:
            self._dirty = False

    def _to_live(self, rec: PromotionRecord) -> None:
        """Write the record's last weighted step into ``live.json``, then clear its mark."""
        last = next(s for s in reversed(rec.steps) if s.weights)
        pin = rec.manifest_sha256
        entries: list[LiveEntry] = [
            (v, w, pin) if v == rec.version and pin else (v, w) for v, w in last.weights.items()
        ]
        self.lock.ensure(f"recording {rec.model}'s live versions")
        self.control.set_live(rec.model, entries)
        self._dirty = True
        rec.live_pending = False
        self.control.save(rec)

    def _reconcile(self, model: str) -> None:
        """The newest weighted record of ``model`` still marked ``live_pending`` goes into ``live.json``."""
        rec = next((r for r in reversed(self.control.history(model)) if any(s.weights for s in r.steps)), None)
        if rec is not None and rec.live_pending:
            log.warning("%s: promotion %s recorded a step live.json lacks; writing it", model, rec.id)
            self._to_live(rec)

    # -- the loop -------------------------------------------------------------------------------

    def tick(self) -> str:
        """One pass; returns ``active`` or ``standby`` (another controller holds the lock)."""
        try:
            return self._tick()
        except LockLost as exc:
            log.warning("%s; standing by", exc)
            self._active = False
            return "standby"

    def _tick(self) -> str:
        if not self.lock.acquire():
            self._active = False
            return "standby"
        if not self._active:  # just became the active controller: make what serves the record
            recorded = self.control.live()
            for m in self.seed.models:
                if m.name not in recorded:
                    self.control.set_live(m.name, [(v.version, v.weight) for v in m.versions])
            self._dirty = True
            self._resumed.clear()
            self._active = True
        blocked = set()  # models whose live.json could not be made to match their record
        for m in self.seed.models:
            try:
                self._reconcile(m.name)
            except Exception as exc:
                log.exception("live.json of %s not written; its promotion waits: %s", m.name, exc)
                blocked.add(m.name)
        if self._dirty:
            self._apply()
        for m in self.current().models:
            try:
                if m.name not in blocked:
                    self._tick_model(m)
            except LockLost:
                raise
            except Exception as exc:  # one model's trouble must not stop the others' promotions
                log.exception("promotion tick of %s failed: %s", m.name, exc)
        self._prune_bases(blocked)
        if self._dirty or getattr(self.applier, "reconcile_each_poll", False):  # also undoes a stale apply
            self._apply()
        return "active"

    # -- adapters and their bases ---------------------------------------------------------------

    def _keep_needed(self, model: str, weights: dict[str, int]) -> dict[str, int]:
        """``weights`` plus, at 0, the versions of ``model`` that adapters serving now run on."""
        return self.bases.keep_needed(self.current(), model, weights)

    def _unbuildable(self, model: str, weights: dict[str, int]) -> str | None:
        """Why the config with ``model`` at ``weights`` could not be deployed (as a deploy builds it)."""
        try:
            cfg = with_live(self.seed, self.live() | {model: list(weights.items())})
            build_serve_config(cfg, self.base, read_manifests=True, seed=self.seed)
        except (ConfigError, ValidationError) as exc:
            return str(exc)
        return None

    def _prune_bases(self, blocked: set[str]) -> None:
        """Remove base versions at weight 0 that no configured adapter version runs on any more; none
        of a base while the manifest of one of its adapter versions cannot be read (any may be needed)."""
        cfg = self.current()
        needed = self.bases.needed(cfg)
        for m in cfg.models:
            if m.base is None and cfg.adapters_of(m) and m.name not in blocked:
                if m.name in needed.unknown:
                    log.warning("%s: no version removed this poll: %s", m.name, needed.unknown[m.name])
                    continue
                rec = self.control.active(m.name)
                idle = [v for v in m.versions if v.weight == 0 and v.version not in needed.versions.get(m.name, set())]
                if idle and (rec is None or not rec.active):
                    self._set(m.name, [(v.version, v.weight) for v in m.versions if v not in idle])
                    _decision(m.name, idle[0].version, "removed", "no live adapter runs on it", {})

    def _tick_model(self, m: ModelConfig) -> None:
        self.lock.ensure(f"taking {m.name}'s requests")
        taken = self.control.take_request(m.name)
        rec = self.control.active(m.name)
        if taken is not None:
            key, request = taken
            try:
                rec = self._handle(m, request, rec)
            except Exception:  # lost the lock, or the store failed a write: the next poll (or
                # the controller that took over) handles the request; none is dropped
                self.control.submit(m.name, request, key)
                raise
        elif rec is None and m.promotion.mode == "auto":
            candidate = self._candidate(m)
            if candidate:
                rec = self._start(m, candidate, "auto", {})
        if rec is not None and rec.active:
            if rec.id not in self._resumed:
                self._resume(rec)
            self._advance(m, rec)
        weights = {v.version: v.weight for v in m.versions}
        self.observe(m.name, weights, rec.status if rec is not None and rec.active else "idle")

    def _candidate(self, m: ModelConfig) -> str | None:
        """The newest version in the store, newer than the live one and never tried."""
        tried = self.control.tried(m.name) | {v.version for v in m.versions}
        live_key = _natural_key(m.live_version)
        newer = [v for v in self.store.list_versions(m.name) if _natural_key(v) > live_key and v not in tried]
        return newer[-1] if newer else None

    def _handle(self, m: ModelConfig, req: PromotionRequest, rec: PromotionRecord | None) -> PromotionRecord | None:
        if req.action == "promote" and req.version:
            if rec is not None and rec.version == req.version:
                return rec  # this request was taken before, started this promotion, then put back
            if rec is not None:
                self._refuse(m, req.version, f"{m.name}@{rec.version} is being promoted; one at a time")
                return rec
            return self._start(m, req.version, "manual", req.overrides)
        if rec is not None:  # abort, or rollback during a promotion: the previous version alone
            why = "aborted by serving promote --abort" if req.action == "abort" else "rolled back by serving rollback"
            self._rollback(rec, why, "aborted" if req.action == "abort" else "rolled_back")
            return rec
        keep = req.version or m.live_version
        if req.action == "rollback" and m.version(keep) is None:
            served = ", ".join(v.version for v in m.versions)
            return self._refuse(m, keep, f"refused: {m.name}@{keep} is not deployed ({m.name} serves {served})")
        if req.action == "rollback" and len(m.versions) > 1:
            self._set(m.name, list(self._keep_needed(m.name, {keep: 100}).items()))
            _decision(m.name, keep, "rollback", f"serving rollback: {keep} alone", {})
        return None

    # -- a promotion ----------------------------------------------------------------------------

    def _refuse(self, m: ModelConfig, version: str, reason: str, source: str = "manual") -> PromotionRecord:
        now = self.clock()
        rec = PromotionRecord(
            id=f"{now:.3f}-{version}", model=m.name, version=version, previous=m.live_version,
            source="auto" if source == "auto" else "manual", status="refused", reason=reason,
            created_at=now, updated_at=now,
        )  # fmt: skip
        rec.steps.append(StepRecord(at=now, phase="refused", note=reason))
        self.lock.ensure(f"recording {m.name}@{version}'s refusal")
        self.control.save(rec)
        _decision(m.name, version, "refused", reason, {})
        return rec

    def _start(self, m: ModelConfig, version: str, source: str, overrides: dict[str, Any]) -> PromotionRecord | None:
        try:
            policy = policy_for(m, overrides)
        except ValueError as exc:
            return self._refuse(m, version, f"refused: {exc}", source)
        if m.version(version) is not None:
            return self._refuse(m, version, f"{m.name}@{version} is already deployed")
        try:
            manifest, pin = self._verified(m, version)
            if m.base is not None:
                self.bases.check(self.current(), m, version)
        except (RegistryError, OSError) as exc:
            if isinstance(exc, OSError) and source == "auto":  # the store may answer next poll: not "tried"
                log.warning("%s@%s could not be read from the store (%s); trying again next poll", m.name, version, exc)
                return None
            why = (
                f"refused: {exc}" if isinstance(exc, RegistryError) else f"refused: the store could not be read: {exc}"
            )
            return self._refuse(m, version, why, source)
        now, live = self.clock(), m.live_version  # after hashing: the deploy timeout starts here
        rec = PromotionRecord(
            id=f"{now:.3f}-{version}", model=m.name, version=version, previous=live,
            source="auto" if source == "auto" else "manual", policy=policy.model_dump(mode="json"),
            created_at=now, updated_at=now, baseline={"before": self._snapshot(m.name)}, manifest_sha256=pin,
        )  # fmt: skip
        self._resumed.add(rec.id)
        scores = {k: v for k, v in (manifest.eval.metrics.items() if manifest.eval else [])}
        weights = {v.version: v.weight for v in m.versions} | {version: 0}
        self._step(rec, "deploy", weights, scores, f"verified {len(manifest.files)} files")
        return rec

    def _verified(self, m: ModelConfig, version: str) -> tuple[Manifest, str]:
        """``store.verify_pinned`` (every file hashed: minutes for a large model on a remote store),
        holding the lock: the manifest and the sha256 of its bytes, which the version's replicas
        are then held to."""
        return self.lock.hold_while(f"verifying {m.name}@{version}", self.store.verify_pinned, m.name, version, m.gate)
