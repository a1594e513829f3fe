"""The steps of one running promotion of ``model@new`` beside ``model@live``, as the controller
(serving.control.controller) takes them, at most one per poll::

    deploying   new at 0 % beside live; wait until its app is RUNNING, then warm it
    stepping    new at steps[i] %, watched for step_seconds (serving.control.watch) and
                online-evaluated once (a score below the manifest's rolls back, whatever the
                traffic, and so does a manifest other than the one the gate checked, the
                version's pin); pass -> next step; extend/hold -> watched longer (up to
                max_step_extensions times, then rolled back); rollback -> live alone again
    finishing   new at 100 %, live at 0 % for drain_seconds; then live removed -> promoted

A step keeps the split that served before the promotion (its versions share what the new one does
not get), and a rollback restores that split. Each step is recorded (the promotion's record, then
``live.json``) before it is applied.

The online eval's prompts are the controller's own: the step's baseline is shifted by what the
metrics counted while it ran, so they never count as the canary's traffic. An eval request that
fails counts as a miss; an eval that raises rolls back, as a score of 0 would.

:class:`PromotionSteps` is the part of :class:`~serving.control.controller.Controller` that takes
these steps; the controller supplies the record, the store and the lock. Its two seams: an
:class:`Applier` makes a config take effect and reads each node's metrics, a :class:`Prober` sends
the warm-up and eval requests.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from serving.config import ModelConfig, PromotionPolicy, StackConfig
from serving.control.bases import AdapterBases
from serving.control.watch import (
    Scrape,
    Verdict,
    VersionStats,
    judge,
    scrape,
    scrape_from_json,
    scrape_json,
    shift,
    unseen,
    window,
)
from serving.lease import LockLost, StoreLock
from serving.manifest import MANIFEST, Manifest, manifest_sha256
from serving.record import ControlStore, PromotionRecord, StepRecord
from serving.registry import CheckpointStore, RegistryError

__all__ = ["Applier", "Prober", "PromotionSteps"]

log = logging.getLogger("raystack.promotion")


class Applier(Protocol):
    """Where a config takes effect: Serve locally, the RayService on Kubernetes."""

    def apply(self, cfg: StackConfig) -> None: ...

    def app_status(self, app: str) -> tuple[str, str]: ...  # (status, message)

    def metrics_by_node(self) -> Mapping[str, str | None]: ...  # node id -> Prometheus text, None if not read


class Prober(Protocol):
    """Requests to ``model@version`` through the gateway."""

    def warm(self, model: str, version: str, n: int, pooling: bool = False) -> None: ...

    def online_eval(self, model: str, version: str, manifest: Manifest, n: int) -> float | None: ...


class PromotionSteps:
    """The steps of a running promotion (see the module docstring), mixed into the controller."""

    seed: StackConfig
    store: CheckpointStore
    control: ControlStore
    lock: StoreLock
    applier: Applier
    prober: Prober
    clock: Callable[[], float]
    bases: AdapterBases
    _resumed: set[str]

    # the controller's own (serving.control.controller.Controller): the record and what applies it

    def _keep_needed(self, model: str, weights: dict[str, int]) -> dict[str, int]:
        raise NotImplementedError

    def _unbuildable(self, model: str, weights: dict[str, int]) -> str | None:
        raise NotImplementedError

    def _to_live(self, rec: PromotionRecord) -> None:
        raise NotImplementedError

    def _apply(self) -> None:
        raise NotImplementedError

    def _step(self, rec: PromotionRecord, phase: str, weights: dict[str, int], fig: dict[str, Any], note: str) -> None:
        """Record a step (the record, then ``live.json``), then apply it. Weights keep the versions
        adapters run on; a config that cannot be built refuses (deploy) or rolls back instead."""
        if weights:
            weights = self._keep_needed(rec.model, weights)
            problem = self._unbuildable(rec.model, weights) if phase != "rollback" else None
            if problem and phase == "deploy":
                rec.status, rec.reason = "refused", f"refused: cannot be served: {problem}"
                return self._step(rec, "refused", {}, {}, rec.reason)
            if problem:
                return self._rollback(rec, f"{phase} {weights} cannot be served: {problem}")
            rec.live_pending = True
        rec.steps.append(StepRecord(at=self.clock(), phase=phase, weights=weights, figures=fig, note=note))
        self.lock.ensure(f"recording {rec.model}@{rec.version}'s {phase} step")
        self.control.save(rec)
        _decision(rec.model, rec.version, phase, note, fig)
        if weights:
            self._to_live(rec)
            self._apply()
        return None

    def _before(self, rec: PromotionRecord) -> dict[str, int]:
        """The split that served before the promotion (its deploy step, less the new version)."""
        deploy = next((s.weights for s in rec.steps if s.weights), {rec.previous: 100})
        return {v: w for v, w in deploy.items() if v != rec.version} or {rec.previous: 100}

    def _rollback(
        self, rec: PromotionRecord, reason: str, status: str = "rolled_back", fig: dict[str, Any] | None = None
    ) -> None:
        rec.status = "aborted" if status == "aborted" else "rolled_back"
        rec.reason = reason
        self._step(rec, "rollback", self._before(rec), fig or {}, reason)

    def _resume(self, rec: PromotionRecord) -> None:
        """A promotion this controller did not start (it restarted): restart the step's window."""
        self._resumed.add(rec.id)
        if rec.status == "stepping":  # its extensions so far still count against max_step_extensions
            rec.step_started_at = self.clock()
            rec.baseline["start"] = self._snapshot(rec.model)
            rec.steps.append(StepRecord(at=self.clock(), phase="resume", note="controller restarted: step re-watched"))
            self.lock.ensure(f"recording {rec.model}@{rec.version}'s resume")
            self.control.save(rec)
            _decision(rec.model, rec.version, "resume", "controller restarted: step re-watched", {})

    def _scrape(self, model: str) -> Scrape:
        return scrape(self.applier.metrics_by_node(), model)

    def _snapshot(self, model: str) -> dict[str, Any]:
        return scrape_json(self._scrape(model))

    def _advance(self, m: ModelConfig, rec: PromotionRecord) -> None:
        policy = PromotionPolicy.model_validate(rec.policy)
        if rec.status == "deploying":
            self._deploying(rec, policy)
        elif rec.status == "stepping":
            self._stepping(rec, policy)
        elif rec.status == "finishing" and self.clock() - rec.steps[-1].at >= policy.drain_seconds:
            rec.status = "promoted"
            kept = [v for v in self._keep_needed(rec.model, {rec.version: 100}) if v != rec.version]
            if kept:
                note = f"promoted; {', '.join(kept)} kept at 0% for the adapters trained on it"
            else:
                note = f"promoted; {rec.previous} drained and removed"
            self._step(rec, "promoted", {rec.version: 100}, {}, note)

    def _deploying(self, rec: PromotionRecord, policy: PromotionPolicy) -> None:
        app = self.bases.app(rec.model, rec.version)
        status, message = self.applier.app_status(app)
        if status in ("DEPLOY_FAILED", "UNHEALTHY"):
            return self._rollback(rec, f"{app} {status}: {message[-600:]}")
        if status != "RUNNING":
            if self.clock() - rec.created_at > policy.deploy_timeout_s:
                self._rollback(rec, f"not RUNNING after {policy.deploy_timeout_s:.0f}s ({status})")
            return None
        try:
            pooling = any(m.name == rec.model and m.engine.runner == "pooling" for m in self.seed.models)
            self.lock.hold_while(
                f"warming {rec.model}@{rec.version}",
                self.prober.warm,
                rec.model,
                rec.version,
                policy.warmup_requests,
                pooling,
            )
        except LockLost:
            raise
        except Exception as exc:
            return self._rollback(rec, f"warm-up failed: {exc}")
        rec.baseline["live_window"] = self._window(rec, "before").get(rec.previous, VersionStats()).to_json()
        self._go(rec, policy, 0)
        return None

    def _go(self, rec: PromotionRecord, policy: PromotionPolicy, i: int) -> None:
        weight = policy.steps[i]
        rec.status, rec.step_index, rec.extensions = "stepping", i, 0
        rec.step_started_at = self.clock()
        rec.baseline["start"] = self._snapshot(rec.model)
        weights = _split(self._before(rec), rec.previous, 100 - weight) | {rec.version: weight}
        self._step(rec, "step", weights, {}, f"{weight}% to {rec.version}")

    def _window(self, rec: PromotionRecord, key: str) -> dict[str, VersionStats]:
        return window(self._scrape(rec.model), scrape_from_json(rec.baseline.get(key, {})))

    def _stepping(self, rec: PromotionRecord, policy: PromotionPolicy) -> None:
        if self.clock() - rec.step_started_at < policy.step_seconds * (1 + rec.extensions):
            return
        now, start = self._scrape(rec.model), scrape_from_json(rec.baseline.get("start", {}))
        stats, base = window(now, start), rec.baseline.get("live_window")
        verdict = judge(
            stats.get(rec.previous, VersionStats()),
            stats.get(rec.version, VersionStats()),
            VersionStats.from_json(base) if base else None,
            policy,
        )
        if verdict.action != "rollback" and rec.baseline.get("evaluated_step") != rec.step_index:
            # once per step, whatever the traffic: the eval prompts are the controller's own
            rec.baseline["evaluated_step"] = rec.step_index
            evaluated = self._online_eval(rec, policy, verdict)
            if evaluated.action == "rollback" or verdict.action == "pass":
                verdict = evaluated
        missing = unseen(now, start)
        if missing and verdict.action != "rollback":
            return self._rewatch(rec, policy, missing, verdict.figures)
        self._decide(rec, policy, verdict)
        return None

    def _rewatch(
        self, rec: PromotionRecord, policy: PromotionPolicy, missing: dict[str, str], fig: dict[str, Any]
    ) -> None:
        """A window some node's part of which is unknown passes nothing: the step is watched again
        from a fresh scrape (an extension; past ``max_step_extensions`` it rolls back)."""
        weight = policy.steps[rec.step_index]
        parts = [f"metrics of node {node[:16]} {how}" for node, how in list(missing.items())[:3]]
        why = "; ".join(parts) + (f"; and {len(missing) - 3} more nodes" if len(missing) > 3 else "")
        fig = {**fig, "nodes_not_counted": len(missing)}
        if rec.extensions >= policy.max_step_extensions:
            return self._rollback(rec, f"at {weight}%: {why}, after {rec.extensions} extensions", fig=fig)
        rec.extensions += 1
        rec.step_started_at = self.clock()
        rec.baseline["start"] = self._snapshot(rec.model)
        return self._step(rec, "extend", {}, fig, f"at {weight}%: {why}; watched again from now")

    def _exclude_probes(self, rec: PromotionRecord, before: Scrape) -> None:
        """Shift the step's baseline by what the metrics counted since ``before`` (the eval's own
        requests), so that the window after the eval holds only other traffic."""
        start = scrape_from_json(rec.baseline.get("start", {}))
        rec.baseline["start"] = scrape_json(shift(start, before, self._scrape(rec.model)))

    def _online_eval(self, rec: PromotionRecord, policy: PromotionPolicy, verdict: Verdict) -> Verdict:
        oe = policy.online_eval
        if oe.samples == 0:
            return verdict
        try:
            manifest, raw = self.store.read_manifest(rec.model, rec.version)
        except RegistryError as exc:  # deleted or cut short in the store since its gate read it
            why = f"{MANIFEST} of {rec.model}@{rec.version} cannot be read from the store: {exc}"
            return Verdict("rollback", why, verdict.figures)
        claimed = manifest.eval.value(oe.metric) if manifest.eval else None
        if rec.manifest_sha256 and manifest_sha256(raw) != rec.manifest_sha256:
            why = f"{MANIFEST} of {rec.model}@{rec.version} changed in the store since its gate checked it"
            return Verdict("rollback", why, {**verdict.figures, "manifest_score": claimed})
        before = self._scrape(rec.model)
        try:
            score = self.lock.hold_while(
                f"evaluating {rec.model}@{rec.version}",
                self.prober.online_eval,
                rec.model,
                rec.version,
                manifest,
                oe.samples,
            )
        except LockLost:
            raise
        except Exception as exc:  # an eval that cannot run scores nothing: it does not pass
            log.exception("online eval of %s@%s failed: %s", rec.model, rec.version, exc)
            return Verdict("rollback", f"online eval failed: {exc}", {**verdict.figures, "manifest_score": claimed})
        self._exclude_probes(rec, before)
        fig = {**verdict.figures, "online_score": score, "manifest_score": claimed}
        if score is None or claimed is None:
            return Verdict("pass", verdict.reason + "; no online eval (no eval rows or no score)", fig)
        if score < claimed - oe.margin:
            why = f"online eval: {oe.metric} {score:.3f} on {oe.samples} held-out prompts vs manifest {claimed:.3f}"
            return Verdict("rollback", f"{why} (margin {oe.margin})", fig)
        return Verdict("pass", f"{verdict.reason}; online {oe.metric} {score:.3f} vs manifest {claimed:.3f}", fig)

    def _decide(self, rec: PromotionRecord, policy: PromotionPolicy, v: Verdict) -> None:
        weight = policy.steps[rec.step_index]
        if v.action == "rollback":
            return self._rollback(rec, f"at {weight}%: {v.reason}", fig=v.figures)
        if v.action in ("extend", "hold"):
            if rec.extensions >= policy.max_step_extensions:
                why = f"at {weight}%: {v.reason}, after {rec.extensions} extensions"
                return self._rollback(rec, why, fig=v.figures)
            rec.extensions += 1
            return self._step(rec, v.action, {}, v.figures, f"at {weight}%: {v.reason}")
        rec.steps.append(StepRecord(at=self.clock(), phase="passed", figures=v.figures, note=f"{weight}%: {v.reason}"))
        _decision(rec.model, rec.version, "passed", f"{weight}%: {v.reason}", v.figures)
        if rec.step_index + 1 < len(policy.steps):
            return self._go(rec, policy, rec.step_index + 1)
        rec.status = "finishing"
        drained = {rec.version: 100} | {v: 0 for v in self._before(rec)}
        self._step(rec, "finish", drained, {}, f"draining {', '.join(v for v in drained if v != rec.version)}")
        return None


def _split(before: dict[str, int], previous: str, share: int) -> dict[str, int]:
    """``share`` % over ``before``'s versions in their proportions (the rounding rest to ``previous``)."""
    total = sum(before.values()) or 1
    out = {v: share * w // total for v, w in before.items()}
    out[previous] = out.get(previous, 0) + share - sum(out.values())
    return out


def _decision(model: str, version: str, phase: str, note: str, figures: dict[str, Any]) -> None:
    """One structured log line per decision (figures only: no prompt or answer text)."""
    line = {"event": "promotion", "model": model, "version": version, "phase": phase, "note": note, **figures}
    log.info(json.dumps(line, default=str))
