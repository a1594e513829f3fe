"""Rules across sections of the stack config, which :class:`~serving.config.StackConfig` runs:
local ports that must differ, keys that must have one holder only, a checkpoint store this
machine can open, and adapter recipes that train what their base can serve."""

from __future__ import annotations

import fsspec

from serving.config.base import DEFAULT_LORA_RANK
from serving.config.cluster import ControllerConfig, LocalRayConfig
from serving.config.gateway import AuthConfig, GatewayConfig
from serving.config.model import LoraSlots, ModelConfig
from serving.redact import redact_uri

__all__ = ["check_adapter_recipes", "check_admin_keys", "check_ports", "check_store_protocol"]


def check_ports(gateway: GatewayConfig, local_ray: LocalRayConfig) -> None:
    """The ports of one local stack: the gateway's, Serve's HTTP proxy's (with ingress serve_proxy
    the gateway's port itself) and the local Ray head's; two equal ones cannot both listen."""
    ports = [("gateway.port", gateway.port)]
    if gateway.ingress == "listener":
        sign = "+" if gateway.serve_proxy_port > gateway.port else "-"
        field = "gateway.proxy_port" if gateway.proxy_port else f"gateway.proxy_port (default gateway.port {sign} 1)"
        ports.append((field, gateway.serve_proxy_port))
    ports += [
        ("local_ray.gcs_port", local_ray.gcs_port),
        ("local_ray.dashboard_port", local_ray.dashboard_port),
        ("local_ray.metrics_export_port", local_ray.metrics_export_port),
    ]
    seen: dict[int, str] = {}
    for field, port in ports:
        if port in seen:
            raise ValueError(f"{seen[port]} and {field} are both {port}: each needs a port of its own")
        seen[port] = field


def check_admin_keys(auth: AuthConfig, controller: ControllerConfig) -> None:
    """An admin key is no tenant's: a tenant's key would otherwise read ``/admin/promotions``.
    (``controller.client_key_env`` may name a tenant's key_env: it is meant to be a tenant's key.)"""
    for t in auth.tenants:
        if controller.admin_key_env and t.key_env == controller.admin_key_env:
            raise ValueError(
                f"controller.admin_key_env and auth.tenants[{t.name}].key_env are both {t.key_env!r}: "
                "the admin key must be no tenant's key"
            )
        shared = [h for h in controller.admin_key_hashes if h in t.key_hashes]
        if shared:
            raise ValueError(
                f"controller.admin_key_hashes and auth.tenants[{t.name}].key_hashes both list {shared[0]!r}: "
                "the admin key must be no tenant's key"
            )


def check_store_protocol(root: str) -> str:
    """A ``checkpoint_root`` URI (or fsspec chain) whose every protocol fsspec knows: a misspelt
    one fails here, naming the field. A known protocol whose filesystem package is not installed
    on this machine passes (``serving render-k8s`` of a ``gs://`` store on a laptop without gcsfs);
    a command that opens the store here then says which package to install."""
    if "://" not in root:
        return root
    links = root.split("::")
    protocols = [link.split("://", 1)[0] if "://" in link else link for link in links[:-1]]
    if "://" in links[-1]:
        protocols.append(links[-1].split("://", 1)[0])
    for protocol in protocols:
        if protocol not in fsspec.available_protocols():
            raise ValueError(
                f"{redact_uri(root)!r}: fsspec knows no protocol {protocol!r} (s3, gs, abfs, file... or a local path)"
            )
    return root


def check_adapter_recipes(models: list[ModelConfig]) -> None:
    """Each adapter version's recipe (method lora) trains what the deploy then serves: on a version
    of the adapter's base that the config serves (``base: <base>@<version>``; the deploy refuses
    an adapter trained on any other), at a rank (``lora_rank``, default ``DEFAULT_LORA_RANK``) the
    base's ``lora.max_lora_rank`` admits."""
    by_name = {m.name: m for m in models}
    for m in models:
        b = by_name.get(m.base) if m.base else None
        if b is None:
            continue  # not an adapter, or a base the config lacks (refused on its own)
        for v in m.versions:
            r = v.recipe
            if r is None or r.method != "lora":
                continue
            field = f"models[{m.name}].versions[{v.version}].recipe"
            name, _, version = r.base.partition("@")
            if name != b.name or b.version(version) is None:
                raise ValueError(
                    f"{field}.base {r.base!r}: an adapter of {b.name!r} trains on a version of it the config serves "
                    f"({', '.join(f'{b.name}@{x.version}' for x in b.versions)}); the deploy refuses any other"
                )
            rank, limit = r.lora_rank or DEFAULT_LORA_RANK, (b.lora or LoraSlots()).max_lora_rank
            if rank > limit:
                shown = f"{field}.lora_rank {rank}" if r.lora_rank else f"{field}.lora_rank (default {rank})"
                raise ValueError(f"{shown} exceeds models[{b.name}].lora.max_lora_rank {limit}")
