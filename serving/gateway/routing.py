"""Routing table: model name / alias / ``model@version`` -> (model, version, Serve app).

Built from the gateway's Serve ``user_config`` so a promotion (new weights, new versions) is
applied in place by ``reconfigure`` without restarting gateway replicas. Pure logic, no Ray.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from serving.errors import NotFound

__all__ = ["ModelRoute", "Resolved", "RoutingTable", "VersionRoute"]


@dataclass(frozen=True)
class VersionRoute:
    version: str
    weight: int
    app: str  # Serve application (and deployment) name of this model version


@dataclass(frozen=True)
class ModelRoute:
    name: str
    aliases: tuple[str, ...]
    versions: tuple[VersionRoute, ...]
    max_model_len: int
    router: str = "power_of_two"
    cold_start_timeout_s: float = 120.0
    scale_to_zero: bool = False
    created: int = 0
    max_ongoing: int = 0  # per replica; a gateway picking directly leases through Serve beyond it

    def version(self, version: str) -> VersionRoute | None:
        return next((v for v in self.versions if v.version == version), None)


@dataclass(frozen=True)
class Resolved:
    model: ModelRoute
    version: VersionRoute


@dataclass
class RoutingTable:
    models: dict[str, ModelRoute] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    default_model: str | None = None

    @classmethod
    def from_user_config(cls, cfg: dict[str, Any]) -> RoutingTable:
        table = cls(default_model=cfg.get("default_model"))
        for m in cfg.get("models", []):
            route = ModelRoute(
                name=m["name"],
                aliases=tuple(m.get("aliases", ())),
                versions=tuple(VersionRoute(**v) for v in m["versions"]),
                max_model_len=int(m["max_model_len"]),
                router=m.get("router", "power_of_two"),
                cold_start_timeout_s=float(m.get("cold_start_timeout_s", 120.0)),
                scale_to_zero=bool(m.get("scale_to_zero", False)),
                created=int(m.get("created", 0)),
                max_ongoing=int(m.get("max_ongoing_requests", 0)),
            )
            table.models[route.name] = route
            for alias in route.aliases:
                table.aliases[alias] = route.name
        return table

    def lookup(self, name: str) -> ModelRoute:
        """A model by name or alias; unknown names are 404 ``model_not_found``."""
        model = self.models.get(self.aliases.get(name, name))
        if model is None:
            raise NotFound(
                f"The model '{name}' does not exist or you do not have access to it.",
                param="model",
                code="model_not_found",
            )
        return model

    def resolve(self, requested: str | None, rng: random.Random | None = None) -> Resolved:
        """Pick the version that serves a request for ``requested`` (``name``, alias or
        ``name@version``). Bare names split traffic by the versions' weights."""
        if not requested:
            if not self.default_model:
                raise NotFound(
                    "No model was named and no default model is configured.", param="model", code="model_not_found"
                )
            requested = self.default_model
        name, _, version = requested.partition("@")
        model = self.lookup(name)
        if version:
            chosen = model.version(version)
            if chosen is None:
                raise NotFound(
                    f"The model '{requested}' does not exist or you do not have access to it.",
                    param="model",
                    code="model_not_found",
                )
            return Resolved(model, chosen)
        return Resolved(model, self._weighted(model, rng or random))

    @staticmethod
    def _weighted(model: ModelRoute, rng: Any) -> VersionRoute:
        live = [v for v in model.versions if v.weight > 0]
        if len(live) == 1:
            return live[0]
        point = rng.uniform(0, sum(v.weight for v in live))
        for v in live:
            point -= v.weight
            if point <= 0:
                return v
        return live[-1]

    def model_ids(self) -> list[tuple[str, ModelRoute]]:
        """Every id a client may use: names, aliases and ``name@version``."""
        out: list[tuple[str, ModelRoute]] = []
        for m in self.models.values():
            out.append((m.name, m))
            out.extend((a, m) for a in m.aliases)
            out.extend((f"{m.name}@{v.version}", m) for v in m.versions)
        return out
