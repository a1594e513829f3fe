"""StackConfig -> Ray Serve config, and the ``import_path`` targets that config names.

:func:`build_serve_config` is the single place where a stack config becomes Serve applications:
``serving up`` deploys its output to the local Ray cluster, and ``serving render-k8s`` writes the
very same dict into the RayService ``serveConfigV2``, so local and Kubernetes cannot drift.

Layout: one application ``gateway`` (route ``/``) plus one application per model version, named
``<model>--<version>`` (no HTTP route; reached only through the gateway). The gateway's routing
table is its Serve ``user_config``: changing weights or adding a version is applied in place.
A LoRA adapter has no application: each of its versions is registered on the replicas of the
base version it was trained on, which list it in their own ``user_config`` (also applied in place).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from serving.config import AutoscalingConfig, ConfigError, ModelConfig, ModelVersion, StackConfig
from serving.control.bases import (
    ManifestUnreadable,
    app_name,
    base_version_for,
    check_no_manifest,
    manifest_bytes,
    trained_on,
)
from serving.gateway.admin import AdminAccess
from serving.gateway.routing import (
    CHAT_CAPABILITIES,
    EMBEDDING_CAPABILITIES,
    GatewayRoutes,
    ModelRoute,
    VersionRoute,
)
from serving.registry import created_at, manifest_at
from serving.replica.engine import EngineSpec
from serving.replica.routers import ROUTER_CLASSES

__all__ = [
    "CONTROLLER_APP",
    "ManifestUnreadable",
    "adapter_bases",
    "admin_access",
    "app_name",
    "base_version_for",
    "build_serve_config",
    "routing_user_config",
    "serving_app",
]

GATEWAY_APP = "gateway"
CONTROLLER_APP = "promotion-controller"
# Fields of GatewayConfig that shape the Serve deployment (options, not init args): kept out of the
# gateway's args, so that scaling the gateway scales it instead of restarting every replica.
GATEWAY_SHAPE: set[str] = {"num_replicas", "autoscaling", "num_cpus"}


def _shed_at(m: ModelConfig) -> int:
    """In-flight requests (per gateway replica) above which low-priority tenants are shed: half
    of what the model's replicas can hold at most (running plus queued)."""
    d = m.deployment
    replicas = d.autoscaling.max_replicas if d.autoscaling else d.num_replicas
    return max(1, (replicas * d.max_ongoing_requests + d.max_queued_requests) // 2)


Bases = dict[tuple[str, str], str]  # (adapter, version) -> the base version it runs on


def adapter_bases(cfg: StackConfig, base: Path | None = None, read_manifests: bool = False) -> Bases:
    """The base version each adapter version runs on: the one its manifest says it was trained on
    (``base.ref``, see :func:`base_version_for`), which must be a configured version of its base
    (any weight, 0 included) whose manifest is the one the adapter's records (``base.manifest_sha256``),
    with a rank the base's ``max_lora_rank`` admits. Without manifests (an offline render, a version
    still to be trained): the base's live version. A manifest that cannot be read now raises
    :class:`ManifestUnreadable` (an OSError): nothing is deployed on a guess."""
    out: Bases = {}
    read = functools.cache(manifest_bytes)  # each base version's manifest once
    for m in cfg.models:
        if m.base is None:
            continue
        b = cfg.model(m.base)
        for v in m.versions:
            manifest = None
            if read_manifests:
                path = cfg.version_path(m, v, base)
                if (manifest := manifest_at(path)) is None:
                    check_no_manifest(path)  # not published (else ManifestUnreadable)
            out[(m.name, v.version)] = trained_on(cfg, m, v, b, manifest, base, read) if manifest else b.live_version
    return out


def serving_app(cfg: StackConfig, model: str, version: str, bases: Bases | None = None) -> str:
    """The Serve application that answers ``model@version``: its own, or for an adapter its base version's."""
    m = cfg.model(model)
    if m.base is None:
        return app_name(model, version)
    found = (bases or {}).get((model, version))
    return app_name(m.base, found or cfg.model(m.base).live_version)


def _route(
    cfg: StackConfig, m: ModelConfig, bases: Bases, created: Callable[[ModelConfig, ModelVersion], int] | None
) -> ModelRoute:
    b = cfg.model(m.base) if m.base else m  # an adapter is served as its base is
    return ModelRoute(
        name=m.name,
        aliases=tuple(m.aliases),
        max_model_len=b.engine.max_model_len,
        router=b.deployment.router,
        cold_start_timeout_s=b.deployment.cold_start_timeout_s,
        scale_to_zero=bool(b.deployment.autoscaling and b.deployment.autoscaling.min_replicas == 0),
        shed_low_priority_at=_shed_at(b),
        max_ongoing_requests=b.deployment.max_ongoing_requests,
        runner=b.engine.runner,
        capabilities=EMBEDDING_CAPABILITIES if b.engine.runner == "pooling" else CHAT_CAPABILITIES,
        base=m.base,
        adapter_routing=m.adapter_routing,
        versions=tuple(
            VersionRoute(
                version=v.version,
                weight=v.weight,
                app=serving_app(cfg, m.name, v.version, bases),
                created=created(m, v) if created else 0,
                adapter=f"{m.name}@{v.version}" if m.base else None,
            )
            for v in m.versions
        ),
    )


def routing_user_config(
    cfg: StackConfig, created: Callable[[ModelConfig, ModelVersion], int] | None = None, bases: Bases | None = None
) -> dict[str, Any]:
    """The gateway's ``user_config``: a :class:`GatewayRoutes` (routes and tenants: key hashes and
    env-var names, never keys) as JSON, validated again by the gateway. ``created`` gives a
    version's manifest time (``serving up`` and promotions read it from the store; 0 without);
    ``bases``, the base version of each adapter version (:func:`adapter_bases`)."""
    placed = bases if bases is not None else adapter_bases(cfg)
    routes = GatewayRoutes(
        default_model=cfg.gateway.default_model,
        auth=cfg.auth,
        models=tuple(_route(cfg, m, placed, created) for m in cfg.models),
    )
    return routes.model_dump(mode="json")


def adapter_sources(
    cfg: StackConfig, m: ModelConfig, v: ModelVersion, base: Path | None, bases: Bases
) -> dict[str, str]:
    """The adapter versions the replicas of base ``m@v`` may register: ``name@version`` -> store path."""
    return {f"{a.name}@{av.version}": cfg.version_path(a, av, base) for a, av in _adapters_on(cfg, m, v, bases)}


def adapter_pins(cfg: StackConfig, m: ModelConfig, v: ModelVersion, bases: Bases) -> dict[str, str]:
    """The manifest pins of :func:`adapter_sources`' versions that have one: ``name@version`` -> sha256."""
    return {
        f"{a.name}@{av.version}": av.manifest_sha256 for a, av in _adapters_on(cfg, m, v, bases) if av.manifest_sha256
    }


def _adapters_on(
    cfg: StackConfig, m: ModelConfig, v: ModelVersion, bases: Bases
) -> Iterator[tuple[ModelConfig, ModelVersion]]:
    """Each adapter version whose base version is ``m@v``."""
    for a in cfg.adapters_of(m):
        for av in a.versions:
            if bases.get((a.name, av.version)) == v.version:
                yield a, av


def _placement(m: ModelConfig) -> dict[str, Any]:
    d = m.deployment
    world = m.engine.tensor_parallel_size * m.engine.pipeline_parallel_size
    bundle: dict[str, float] = {"CPU": d.cpus_per_rank}
    if d.gpus_per_rank:
        bundle["GPU"] = d.gpus_per_rank
    return {
        # The replica actor itself sits in bundle 0 and uses that rank's resources.
        "ray_actor_options": {"num_cpus": d.cpus_per_rank, "num_gpus": d.gpus_per_rank},
        "placement_group_bundles": [dict(bundle) for _ in range(world)],
        "placement_group_strategy": "STRICT_PACK",
    }


def _autoscaling(a: AutoscalingConfig) -> dict[str, Any]:
    return {
        "min_replicas": a.min_replicas,
        "max_replicas": a.max_replicas,
        "initial_replicas": a.initial_replicas,
        "target_ongoing_requests": a.target_ongoing_requests,
        "upscale_delay_s": a.upscale_delay_s,
        "downscale_delay_s": a.downscale_delay_s,
        "metrics_interval_s": a.metrics_interval_s,
        "look_back_period_s": a.look_back_period_s,
    }


def _model_deployment(
    m: ModelConfig, name: str, grace_s: float, adapters: dict[str, str] | None, pins: dict[str, str] | None = None
) -> dict[str, Any]:
    d = m.deployment
    out: dict[str, Any] = {
        "name": name,
        "max_ongoing_requests": d.max_ongoing_requests,
        "max_queued_requests": d.max_queued_requests,
        "health_check_period_s": 2,
        "health_check_timeout_s": 10,
        "graceful_shutdown_wait_loop_s": 1,
        "graceful_shutdown_timeout_s": grace_s,
        **_placement(m),
    }
    if d.autoscaling is not None:
        out["autoscaling_config"] = _autoscaling(d.autoscaling)
    else:
        out["num_replicas"] = d.num_replicas
    router = ROUTER_CLASSES[d.router]
    if router:
        out["request_router_config"] = {"request_router_class": router}
    if adapters is not None:  # a base of adapters: registered at run time, so a change restarts nothing
        out["user_config"] = {"adapters": adapters} | ({"pins": pins} if pins else {})
    return out


def _model_application(
    cfg: StackConfig, m: ModelConfig, v: ModelVersion, base: Path | None, bases: Bases
) -> dict[str, Any]:
    name = app_name(m.name, v.version)
    lora = cfg.lora_slots(m)
    spec = EngineSpec(
        model=m.name,
        version=v.version,
        path=cfg.version_path(m, v, base),
        manifest_sha256=v.manifest_sha256,
        engine=m.engine,
        use_gpu=m.deployment.gpus_per_rank > 0,
        gpus_per_rank=m.deployment.gpus_per_rank,
        cpus_per_rank=m.deployment.cpus_per_rank,
        startup_timeout_s=m.deployment.startup_timeout_s,
        stall_timeout_s=m.deployment.stall_timeout_s,
        shutdown_grace_s=cfg.shutdown.grace_s,
        secret_env=sorted(_key_envs(cfg)),
        lora=lora,
        kv_events=m.deployment.router == "kv_aware",
    )
    adapters = adapter_sources(cfg, m, v, base, bases) if lora else None
    pins = adapter_pins(cfg, m, v, bases) if lora else None
    args = spec.model_dump(mode="json", exclude={"manifest_sha256"} if spec.manifest_sha256 is None else None)
    return {
        "name": name,
        "route_prefix": None,
        "import_path": "serving.replica.server:build_model_server",
        "args": {"name": name, "spec": args},
        "deployments": [_model_deployment(m, name, cfg.shutdown.grace_s, adapters, pins)],
    }


def _controller_application(seed: StackConfig, base: Path | None) -> dict[str, Any]:
    """The promotion controller's app; its args are the stack config as written (``seed``), not
    the live versions, so that applying a promotion step never changes (restarts) it."""
    on_k8s = seed.controller.target == "kubernetes"
    options: dict[str, Any] = {"num_cpus": 0.05}
    if on_k8s:  # its own worker group, whose pods run under the controller's service account and
        # offer no CPU: no other replica (gateways, engines) can be placed there
        options = {"num_cpus": 0, "resources": {"raystack-promotion": 1}}
    return {
        "name": CONTROLLER_APP,
        "route_prefix": None,
        "import_path": "serving.control.controller_app:build_promotion_controller",
        "args": {"config": seed.model_dump(mode="json"), "base": str(base) if base else None},
        "deployments": [
            {
                "name": "PromotionController",
                "num_replicas": 1,
                "ray_actor_options": options,
                "health_check_period_s": 10,
                "health_check_timeout_s": 30,
                "graceful_shutdown_timeout_s": seed.shutdown.grace_s,
            }
        ],
    }


def _key_envs(cfg: StackConfig) -> set[str]:
    """Every variable that holds one of the stack's API keys: the tenants', the admin's and the
    promotion controller's client key (a tenant's key too)."""
    controller = {cfg.controller.admin_key_env, cfg.controller.client_key_env}
    return {t.key_env for t in cfg.auth.tenants if t.key_env} | {e for e in controller if e}


def admin_access(cfg: StackConfig, base: Path | None) -> AdminAccess:
    """The gateway's admin routes: the record they read and the admin keys (hashes, env name)."""
    c = cfg.controller
    return AdminAccess(
        store_root=cfg.store_root(base),
        stack=cfg.name,
        key_hashes=c.admin_key_hashes,
        key_env=c.admin_key_env,
        timeout_s=c.admin_timeout_s,
    )


def _check_app_names(models: list[ModelConfig]) -> None:
    """Refuse two model versions whose Serve application names are the same (``app_name`` folds
    case, ``.`` and ``_``: ``v1`` and ``V1``): Serve would run one application for both."""
    seen: dict[str, str] = {}
    for m in models:
        for v in m.versions:
            name, label = app_name(m.name, v.version), f"{m.name}@{v.version}"
            if name in seen:
                raise ConfigError(f"{seen[name]} and {label} would both be the Serve application {name!r}; rename one")
            seen[name] = label


def build_serve_config(
    cfg: StackConfig, base: Path | None = None, read_manifests: bool = False, seed: StackConfig | None = None
) -> dict[str, Any]:
    """The complete Serve config (the ``serve deploy`` schema) for a stack config.

    ``base`` resolves relative checkpoint paths (the config file's folder); on Kubernetes the
    checkpoint root is absolute or a URI, and ``base`` is None. ``cfg`` carries the live versions
    (the record applied); ``seed``, the config as written, is what the promotion controller gets
    (default: ``cfg``). ``read_manifests``: read each version's creation time from its manifest
    (a deploy does; rendering offline does not).
    """
    g, sd = cfg.gateway, cfg.shutdown
    bases = adapter_bases(cfg, base, read_manifests)
    gateway = {
        "name": GATEWAY_APP,
        "route_prefix": "/",
        "import_path": "serving.gateway.deployment:build_gateway",
        # the gateway's own config, validated again on the replica (GatewayConfig.model_validate)
        "args": {
            "config": g.model_dump(mode="json", exclude=GATEWAY_SHAPE),
            "shutdown": sd.model_dump(mode="json"),
            **({"admin": admin_access(cfg, base).model_dump(mode="json")} if cfg.controller.has_admin_key else {}),
        },
        "deployments": [
            {
                "name": "Gateway",
                **(
                    {"autoscaling_config": _autoscaling(g.autoscaling)}
                    if g.autoscaling
                    else {"num_replicas": g.num_replicas}
                ),
                "max_ongoing_requests": 1000,
                "ray_actor_options": {"num_cpus": g.num_cpus},
                "user_config": routing_user_config(
                    cfg, (lambda m, v: created_at(cfg.version_path(m, v, base))) if read_manifests else None, bases
                ),
                "graceful_shutdown_timeout_s": sd.grace_s,
                # a restarted gateway replica (new code or settings) starts before the old one
                # stops: the port always has a listener, even with one replica
                "max_surge_percent": 100,
            }
        ],
    }
    models = [m for m in cfg.models if m.base is None]
    _check_app_names(models)
    apps = [gateway] + [_model_application(cfg, m, v, base, bases) for m in models for v in m.versions]
    if cfg.controller.enabled:
        apps.append(_controller_application(seed or cfg, base))
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": g.host, "port": g.serve_proxy_port, "keep_alive_timeout_s": 60},
        "applications": apps,
    }
