"""The stack config: one YAML file per environment, validated here, used everywhere.

One config, one path: ``deployments/<env>.yaml`` -> :class:`StackConfig` -> the Serve config
(:mod:`serving.control.serve_config`) that runs locally *and* is rendered into the RayService ``serveConfigV2``.
Every model rejects unknown fields, so a typo fails loudly with the file and field named.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from serving.config.base import IMAGE_RE, ConfigError, Strict, check_model_name, read_yaml, validation_message
from serving.config.checks import check_adapter_recipes, check_admin_keys, check_ports, check_store_protocol
from serving.config.cluster import (
    LOCAL_RAY_LOOPBACK,
    ControllerConfig,
    KubernetesConfig,
    LocalRayConfig,
    ShutdownConfig,
)
from serving.config.gateway import AuthConfig, GatewayConfig, ResponseStoreConfig, TenantConfig
from serving.config.model import (
    AdapterRouting,
    AutoscalingConfig,
    DeploymentOptions,
    EngineConfig,
    LoraSlots,
    ModelConfig,
    ModelVersion,
    OnlineEval,
    PromotionPolicy,
    RouterName,
    RunnerName,
    TrainRecipe,
)

__all__ = [
    "IMAGE_RE",
    "LOCAL_RAY_LOOPBACK",
    "AdapterRouting",
    "AuthConfig",
    "AutoscalingConfig",
    "ConfigError",
    "ControllerConfig",
    "DeploymentOptions",
    "EngineConfig",
    "GatewayConfig",
    "KubernetesConfig",
    "LocalRayConfig",
    "LoraSlots",
    "ModelConfig",
    "ModelVersion",
    "OnlineEval",
    "PromotionPolicy",
    "ResponseStoreConfig",
    "RouterName",
    "RunnerName",
    "ShutdownConfig",
    "StackConfig",
    "TenantConfig",
    "TrainRecipe",
    "load_config",
    "parse_config",
    "read_yaml",
    "validation_message",
]


class StackConfig(Strict):
    """A whole environment: gateway plus models."""

    name: str = Field(
        "local",
        description="Stack name (the rule of model names): local state in .run/<name>.*, the promotion "
        "record in <checkpoint_root>/.control/<name>/.",
    )
    checkpoint_root: str = Field(
        "checkpoints", description="Local path or fsspec URI (its filesystem package installed where it is read)."
    )
    gateway: GatewayConfig = Field(GatewayConfig(), description="The OpenAI-compatible ingress.")
    auth: AuthConfig = Field(description="Required: keys and tenants, or an explicit `mode: open`.")
    local_ray: LocalRayConfig = Field(LocalRayConfig(), description="Only for `serving up`.")
    shutdown: ShutdownConfig = Field(ShutdownConfig(), description="Draining budget of stopping replicas.")
    kubernetes: KubernetesConfig = Field(KubernetesConfig(), description="Only for `serving render-k8s`.")
    controller: ControllerConfig = Field(ControllerConfig(), description="The promotion controller.")
    models: list[ModelConfig] = Field(min_length=1, description="Models served at the same time.")

    @field_validator("name")
    @classmethod
    def _stack_name(cls, v: str) -> str:
        return check_model_name(v, "the stack name")  # a part of file paths

    @field_validator("checkpoint_root")
    @classmethod
    def _store_protocol(cls, v: str) -> str:
        return check_store_protocol(v)

    @model_validator(mode="after")
    def _apart(self) -> StackConfig:
        check_ports(self.gateway, self.local_ray)
        check_admin_keys(self.auth, self.controller)
        return self

    @model_validator(mode="after")
    def _unique_names(self) -> StackConfig:
        seen: dict[str, str] = {}
        for m in self.models:
            for n in [m.name, *m.aliases]:
                if n in seen:
                    raise ValueError(f"name {n!r} used twice (by {seen[n]!r} and {m.name!r})")
                seen[n] = m.name
        if self.gateway.default_model and self.gateway.default_model not in seen:
            raise ValueError(f"gateway.default_model {self.gateway.default_model!r} is no model")
        for t in self.auth.tenants:
            unknown = [m for m in t.models if m != "*" and seen.get(m) != m]
            if unknown:
                raise ValueError(f"tenant {t.name!r} allows unknown models {unknown}")
        by_name = {m.name: m for m in self.models}
        for m in self.models:
            base = by_name.get(m.base) if m.base else None
            if m.base and (base is None or base.is_adapter or base.engine.runner != "generate"):
                raise ValueError(f"adapter {m.name!r}: its base {m.base!r} must be a generating model of this config")
        return self

    @model_validator(mode="after")
    def _recipes(self, info: ValidationInfo) -> StackConfig:
        """Recipes say how ``serving up`` builds the config as written: a config of the live versions
        (validated with context ``{"live": True}``) may have dropped a base version one names."""
        if not (info.context or {}).get("live"):
            check_adapter_recipes(self.models)
        return self

    def model(self, name: str) -> ModelConfig:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)

    def lora_slots(self, model: ModelConfig) -> LoraSlots | None:
        """A base's LoRA settings: its ``lora``, else the defaults when an adapter names it."""
        if model.lora is not None:
            return model.lora
        return LoraSlots() if any(m.base == model.name for m in self.models) else None

    def adapters_of(self, model: ModelConfig) -> list[ModelConfig]:
        return [m for m in self.models if m.base == model.name]

    def store_root(self, base: Path | None) -> str:
        """The checkpoint store's root; a relative path is taken from the config file's folder."""
        root = self.checkpoint_root
        if "://" not in root and not Path(root).is_absolute() and base is not None:
            root = str((base / root).resolve())
        return root

    def version_path(self, model: ModelConfig, version: ModelVersion, base: Path | None) -> str:
        """Where a version's weights live; relative paths are taken from the config file's folder."""
        raw = version.path or f"{self.checkpoint_root.rstrip('/')}/{model.name}/{version.version}"
        if "://" in raw or base is None or Path(raw).is_absolute():
            return raw
        return str((base / raw).resolve())


def parse_config(data: object, source: str = "<config>") -> StackConfig:
    """Validate already-loaded YAML data; errors name the source and each failing field."""
    try:
        return StackConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(validation_message(source, "stack config", exc, data)) from None


def load_config(path: str | Path) -> StackConfig:
    """Read and validate a stack config file."""
    p = Path(path)
    return parse_config(read_yaml(p, ConfigError, "no such config file"), str(p))
