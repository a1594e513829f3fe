"""Routing table: model name / alias / ``model@version`` -> (model, version, Serve app).

Built from the gateway's Serve ``user_config`` so a promotion (new weights, new versions) is
applied in place by ``reconfigure`` without restarting gateway replicas. The ``user_config`` is a
:class:`GatewayRoutes` dumped to JSON by the control plane
(:func:`serving.control.serve_config.routing_user_config`) and validated here: every field is
required, so no default is restated on this side of the Serve boundary. Pure logic, no Ray.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from serving.config import AdapterRouting, AuthConfig, RouterName, RunnerName
from serving.errors import NotFound

__all__ = [
    "CHAT_CAPABILITIES",
    "EMBEDDING_CAPABILITIES",
    "GatewayRoutes",
    "ModelRoute",
    "Resolved",
    "RoutingTable",
    "VersionRoute",
]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


CHAT_CAPABILITIES = ("chat", "completions", "responses", "messages", "tokenize")
EMBEDDING_CAPABILITIES = ("embeddings", "tokenize")  # a pooling model (engine.runner: pooling)


class VersionRoute(_Wire):
    version: str
    weight: int
    app: str  # Serve application (and deployment) name of this model version; an adapter's: its base version's
    created: int = 0  # the version's manifest creation time (Unix seconds; 0: unknown), shown by /v1/models
    adapter: str | None = None  # a LoRA adapter version: the name it is registered under (name@version)

    @property
    def served_name(self) -> str | None:
        """The ``model`` the engine is sent: the adapter's registered name (None: the base's own)."""
        return self.adapter


class ModelRoute(_Wire):
    name: str
    aliases: tuple[str, ...]
    versions: tuple[VersionRoute, ...]
    max_model_len: int
    router: RouterName
    cold_start_timeout_s: float
    scale_to_zero: bool
    shed_low_priority_at: int  # in-flight requests (this gateway replica) above which low priority is shed
    max_ongoing_requests: int  # per replica; a gateway picking directly leases through Serve beyond it
    runner: RunnerName  # pooling: embeddings only; generate: everything but embeddings
    capabilities: tuple[str, ...] = CHAT_CAPABILITIES  # the APIs it serves, shown by /v1/models
    base: str | None = None  # a LoRA adapter: the model whose replicas serve it
    adapter_routing: AdapterRouting = "loaded_first"

    def version(self, version: str) -> VersionRoute | None:
        return next((v for v in self.versions if v.version == version), None)

    @property
    def live(self) -> VersionRoute:
        """The version with the largest share of traffic (first on ties)."""
        return max(self.versions, key=lambda v: v.weight)


class GatewayRoutes(_Wire):
    """The gateway's Serve ``user_config``: routes and tenants (key hashes and env-var names,
    never keys)."""

    default_model: str | None
    auth: AuthConfig
    models: tuple[ModelRoute, ...]


@dataclass(frozen=True)
class Resolved:
    model: ModelRoute
    version: VersionRoute
    pinned: bool = False  # named as ``name@version``, not drawn by the traffic split


@dataclass
class RoutingTable:
    models: dict[str, ModelRoute] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    default_model: str | None = None

    @classmethod
    def from_routes(cls, routes: GatewayRoutes) -> RoutingTable:
        table = cls(default_model=routes.default_model)
        for route in routes.models:
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
        name, at, version = requested.partition("@")
        model = self.lookup(name)
        if at:  # ``name@`` names no version: an error, not the split
            chosen = model.version(version) if version else None
            if chosen is None:
                raise NotFound(
                    f"The model '{requested}' does not exist or you do not have access to it.",
                    param="model",
                    code="model_not_found",
                )
            return Resolved(model, chosen, pinned=True)
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

    def model_card(self, model_id: str) -> dict[str, object]:
        """The ``/v1/models`` entry of an id from :meth:`model_ids`: ``created`` is the named
        version's manifest time, for a bare name or alias the live version's."""
        name, _, version = model_id.partition("@")
        m = self.lookup(name)
        v = m.version(version) if version else m.live
        return {
            "id": model_id,
            "object": "model",
            "created": v.created if v else 0,
            "owned_by": "raystack",
            "root": m.name,
            "max_model_len": m.max_model_len,
            "capabilities": list(m.capabilities),
            **({"parent": m.base} if m.base else {}),
        }

    def model_ids(self) -> list[tuple[str, ModelRoute]]:
        """Every id a client may use: names, aliases and ``name@version``."""
        out: list[tuple[str, ModelRoute]] = []
        for m in self.models.values():
            out.append((m.name, m))
            out.extend((a, m) for a in m.aliases)
            out.extend((f"{m.name}@{v.version}", m) for v in m.versions)
        return out
