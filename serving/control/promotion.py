"""Promotion: deploy a new version beside the live one, warm it, shift traffic in steps while
watching its SLOs against the live version, then finish (drain and remove the old version) or
roll back automatically, leaving the old version serving.

Every step is a change of the Serve config built from the stack config, applied the same way as
``serving up`` (declaratively, in place: only the gateway's ``user_config`` changes while weights
shift, so no replica restarts). The versions and weights that are live are recorded in
``.run/<stack>.versions.json`` (the *routes file*), which ``serving up`` applies on top of the YAML,
so a promotion's outcome survives restarts of gateway replicas and of the whole local stack.
On Kubernetes the same promotion is an edit of ``deployments/<env>.yaml`` rendered into
``serveConfigV2`` (docs/operations.md).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from serving.config import ModelConfig, ModelVersion, StackConfig
from serving.control.serve_config import app_name
from serving.metrics import samples
from serving.registry import CheckpointStore, Manifest, RegistryError

__all__ = [
    "PromotionError",
    "PromotionResult",
    "SloPolicy",
    "VersionStats",
    "apply_routes",
    "compare",
    "parse_stats",
    "promote",
    "rollback",
    "routes_path",
]


class PromotionError(RuntimeError):
    """The promotion was refused before any traffic moved (bad version, failed gate)."""


@dataclass(frozen=True)
class SloPolicy:
    steps: tuple[int, ...] = (10, 50, 100)
    step_seconds: float = 30.0
    min_requests: int = 5  # per step, for the new version, before judging it
    max_error_rate_increase: float = 0.02
    max_ttft_ratio: float = 2.0
    ttft_slack_s: float = 0.05
    deploy_timeout_s: float = 600.0
    warmup_requests: int = 3
    drain_seconds: float = 5.0


@dataclass
class VersionStats:
    requests: float = 0.0
    errors: float = 0.0
    ttft_sum: float = 0.0
    ttft_count: float = 0.0

    def minus(self, other: VersionStats) -> VersionStats:
        return VersionStats(
            self.requests - other.requests,
            self.errors - other.errors,
            self.ttft_sum - other.ttft_sum,
            self.ttft_count - other.ttft_count,
        )

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    @property
    def ttft(self) -> float | None:
        return self.ttft_sum / self.ttft_count if self.ttft_count else None


@dataclass
class PromotionResult:
    model: str
    version: str
    previous: str
    status: str = "running"  # running | promoted | rolled_back | refused
    reason: str = ""
    log: list[str] = field(default_factory=list)


# -- routes file -------------------------------------------------------------------------------


def routes_path(run_dir: Path, stack: str) -> Path:
    return run_dir / f"{stack}.versions.json"


def apply_routes(cfg: StackConfig, path: Path) -> StackConfig:
    """The stack config with the live versions and weights recorded by promotions applied."""
    if not path.exists():
        return cfg
    routes: dict[str, list[dict[str, Any]]] = json.loads(path.read_text())
    models = []
    for m in cfg.models:
        if m.name in routes:
            known = {v.version: v for v in m.versions}
            versions = [
                known[r["version"]].model_copy(update={"weight": r["weight"]})
                if r["version"] in known
                else ModelVersion(version=r["version"], weight=r["weight"])
                for r in routes[m.name]
            ]
            m = m.model_copy(update={"versions": versions})
        models.append(m)
    return StackConfig.model_validate({**cfg.model_dump(), "models": [x.model_dump() for x in models]})


def _scores(manifest: Manifest) -> str:
    if manifest.eval is None:
        return "no evaluation recorded"
    return ", ".join(f"{k} {v:.3f}" for k, v in sorted(manifest.eval.metrics.items()))


def _with_versions(cfg: StackConfig, model: str, versions: list[tuple[str, int]]) -> StackConfig:
    m = cfg.model(model)
    known = {v.version: v for v in m.versions}
    new = [
        known[v].model_copy(update={"weight": w}) if v in known else ModelVersion(version=v, weight=w)
        for v, w in versions
    ]
    models = [(x.model_copy(update={"versions": new}) if x.name == model else x).model_dump() for x in cfg.models]
    return StackConfig.model_validate({**cfg.model_dump(), "models": models})


def _save_routes(path: Path, cfg: StackConfig, model: str) -> None:
    routes = json.loads(path.read_text()) if path.exists() else {}
    routes[model] = [{"version": v.version, "weight": v.weight} for v in cfg.model(model).versions]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(routes, indent=2))
    tmp.replace(path)


# -- SLO comparison ----------------------------------------------------------------------------


def parse_stats(text: str, model: str) -> dict[str, VersionStats]:
    """Per-version request, error and TTFT totals of one model from a Prometheus exposition of
    the stack's metrics (Ray's exporter prefixes ``ray_``)."""
    out: dict[str, VersionStats] = {}
    for name, labels, value in samples(text, "raystack_"):
        if labels.get("model") != model or "version" not in labels:
            continue
        s = out.setdefault(labels["version"], VersionStats())
        base = name.removeprefix("ray_")
        if base in ("raystack_requests_total", "raystack_requests"):
            s.requests += value
            if labels.get("status_class") == "5xx":
                s.errors += value
        elif base == "raystack_time_to_first_token_seconds_sum":
            s.ttft_sum += value
        elif base == "raystack_time_to_first_token_seconds_count":
            s.ttft_count += value
    return out


def compare(live: VersionStats, new: VersionStats, policy: SloPolicy) -> str | None:
    """Why the new version breaks its SLO against the live one, or None if it holds."""
    if new.error_rate > live.error_rate + policy.max_error_rate_increase:
        return f"error rate {new.error_rate:.1%} vs live {live.error_rate:.1%}"
    if new.ttft is not None and live.ttft is not None:
        limit = live.ttft * policy.max_ttft_ratio + policy.ttft_slack_s
        if new.ttft > limit:
            return f"mean TTFT {new.ttft * 1000:.0f} ms vs live {live.ttft * 1000:.0f} ms (limit {limit * 1000:.0f} ms)"
    return None


# -- the promotion -----------------------------------------------------------------------------


class Deployer(Protocol):
    def apply(self, cfg: StackConfig) -> None: ...

    def wait_running(self, apps: list[str], timeout_s: float) -> None: ...

    def metrics_text(self) -> str: ...


def _warm(base_url: str, m: ModelConfig, version: str, n: int, headers: dict[str, str]) -> None:
    model = m.name
    body: dict[str, object]
    if m.engine.runner == "pooling":
        path, body = "/v1/embeddings", {"model": f"{model}@{version}", "input": "1+1="}
    else:
        path, body = "/v1/completions", {"model": f"{model}@{version}", "prompt": "1+1=", "max_tokens": 2}
    for _ in range(n):
        r = httpx.post(f"{base_url}{path}", json=body, headers=headers, timeout=120)
        if r.status_code != 200:
            raise RuntimeError(f"warm-up request to {model}@{version} answered {r.status_code}: {r.text[:300]}")


def promote(
    cfg: StackConfig,
    model: str,
    version: str,
    *,
    store: CheckpointStore,
    deployer: Deployer,
    routes_file: Path,
    base_url: str,
    policy: SloPolicy = SloPolicy(),
    headers: dict[str, str] | None = None,
    log: Callable[[str], None] = print,
    sleep: Callable[[float], None] = time.sleep,
) -> PromotionResult:
    """Promote ``model@version`` (see the module docstring). Never raises once traffic moved:
    failures end in ``rolled_back`` with the previous version serving alone."""
    m = cfg.model(model)
    live = m.live_version
    result = PromotionResult(model, version, live)

    def note(msg: str) -> None:
        result.log.append(msg)
        log(msg)

    if version == live or m.version(version) is not None:
        raise PromotionError(f"{model}@{version} is already deployed")
    try:
        manifest = store.verify(model, version, m.gate)
    except RegistryError as exc:
        result.status, result.reason = "refused", str(exc)
        note(f"refused: {exc}")
        return result
    note(f"verified {model}@{version}: {_scores(manifest)}, {len(manifest.files)} files hashed")
    stable = _with_versions(cfg, model, [(live, 100)])
    current = _with_versions(cfg, model, [(live, 100), (version, 0)])
    try:
        deployer.apply(current)
        deployer.wait_running([app_name(model, version)], policy.deploy_timeout_s)
        _warm(base_url, m, version, policy.warmup_requests, headers or {})
        note(f"{model}@{version} deployed beside {live} and warm")
        for weight in policy.steps:
            current = _with_versions(cfg, model, [(live, 100 - weight), (version, weight)])
            before = parse_stats(deployer.metrics_text(), model)
            deployer.apply(current)
            note(f"step: {version} {weight}% / {live} {100 - weight}%")
            reason = _watch(deployer, model, live, version, before, policy, sleep, weight)
            if reason:
                raise RuntimeError(f"SLO broken at {weight}%: {reason}")
    except Exception as exc:  # roll back: the previous version alone, the new one removed
        note(f"rolling back: {exc}")
        deployer.apply(stable)
        _save_routes(routes_file, stable, model)
        result.status, result.reason = "rolled_back", str(exc)
        return result
    # finish: stop routing to the old version, let its requests drain, then remove it
    final = _with_versions(cfg, model, [(version, 100)])
    draining = _with_versions(cfg, model, [(version, 100), (live, 0)])
    deployer.apply(draining)
    sleep(policy.drain_seconds)
    deployer.apply(final)
    _save_routes(routes_file, final, model)
    result.status = "promoted"
    note(f"promoted {model}@{version}; {live} drained and removed")
    return result


def _watch(
    deployer: Deployer,
    model: str,
    live: str,
    new: str,
    before: dict[str, VersionStats],
    policy: SloPolicy,
    sleep: Callable[[float], None],
    weight: int,
) -> str | None:
    """Wait one step, then compare the step's deltas (up to 3 steps long if traffic is thin)."""
    for _ in range(3):
        sleep(policy.step_seconds)
        after = parse_stats(deployer.metrics_text(), model)
        d_new = after.get(new, VersionStats()).minus(before.get(new, VersionStats()))
        d_live = after.get(live, VersionStats()).minus(before.get(live, VersionStats()))
        if d_new.requests >= policy.min_requests or weight == 100:
            return compare(d_live, d_new, policy)
    return None  # too little traffic to judge: the step passes on deploy health alone


def rollback(cfg: StackConfig, model: str, deployer: Deployer, routes_file: Path, to: str | None = None) -> str:
    """Manual rollback: serve ``to`` (default: the live version) alone and remove the others."""
    m = cfg.model(model)
    target = to or m.live_version
    if m.version(target) is None:
        raise PromotionError(f"{model}@{target} is not deployed")
    stable = _with_versions(cfg, model, [(target, 100)])
    deployer.apply(stable)
    _save_routes(routes_file, stable, model)
    return target


def save_result(run_dir: Path, stack: str, result: PromotionResult) -> Path:
    path = run_dir / f"{stack}.promotion-{result.model}.json"
    path.write_text(json.dumps(asdict(result), indent=2))
    return path
