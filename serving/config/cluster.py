"""Where the stack runs: the local Ray head of ``serving up``, how replicas drain when they stop,
what ``serving render-k8s`` renders for Kubernetes, and the promotion controller."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from serving.config.base import IMAGE_RE, Strict, check_key_hashes

__all__ = ["LOCAL_RAY_LOOPBACK", "ControllerConfig", "KubernetesConfig", "LocalRayConfig", "ShutdownConfig"]


class LocalRayConfig(Strict):
    """The local Ray head that ``serving up`` starts (loopback only). Not used on Kubernetes."""

    gcs_port: int = Field(6379, ge=1024, le=65535, description="Ray GCS port of the local head.")
    dashboard_port: int = Field(8265, ge=1024, le=65535, description="Dashboard/job API (loopback, token auth).")
    metrics_export_port: int = Field(
        8080, ge=1024, le=65535, description="Ray's Prometheus endpoint (all stack metrics)."
    )
    num_cpus: int = Field(
        8,
        ge=1,
        description="Logical CPUs Ray may schedule: room for every replica's reservation (engine ranks' "
        "cpus_per_rank, gateways' num_cpus); it may exceed the cores, as it is a scheduling count only.",
    )
    serve_control_loop_s: float = Field(
        0.1,
        gt=0,
        le=5,
        description="Serve controller's reconcile period (Ray's default; 0.5 cuts Ray's idle CPU ~20% but "
        "config changes reach the gateway later, docs/performance.md).",
    )


# The environment of every local, one-node Ray (the stack's head and its drivers, the training
# job's own): Ray replaces a loopback node address with the machine's network address, so that
# other nodes can join, unless multi-node clusters are switched off. With them on, its metrics
# ports would listen on every interface without authentication, and its daemons and the model
# engines (which listen on Ray's node address) on the network's. Off, all of them listen on
# 127.0.0.1. torch's gloo (the ranks of a CPU engine of several ranks, the training job's DDP)
# and NCCL's bootstrap bind the address the host name resolves to, unauthenticated, unless told
# an interface: loopback, inherited by every Ray worker and engine.
LOCAL_RAY_LOOPBACK: dict[str, str] = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "GLOO_SOCKET_IFNAME": "lo",
    "NCCL_SOCKET_IFNAME": "lo",
}


class ShutdownConfig(Strict):
    """How replicas stop: one budget for Serve's graceful shutdown and the pods' termination grace."""

    grace_s: float = Field(
        60,
        ge=20,
        le=3600,
        description="Serve's graceful_shutdown_timeout_s of every deployment: a stopping replica's whole drain "
        "fits in it. On Kubernetes every serving pod's terminationGracePeriodSeconds is at least "
        "notice_s + grace_s (checked by the manifest tests).",
    )
    notice_s: float = Field(
        5,
        ge=0,
        le=60,
        description="How long a stopping gateway replica keeps serving with readiness failed (503 on "
        "/-/healthz, `connection: close`) before it closes its listener: the time a load balancer needs to "
        "notice. On Kubernetes also the serving pods' preStop sleep.",
    )

    @property
    def listener_drain_s(self) -> float:
        """What a stopping gateway replica's listener gives its requests in flight: what is left
        of Serve's graceful shutdown after ``notice_s``, less a margin to close its clients."""
        return self.grace_s - self.notice_s - 5

    @model_validator(mode="after")
    def _fits(self) -> ShutdownConfig:
        if self.notice_s + 10 > self.grace_s:
            raise ValueError("grace_s must exceed notice_s by at least 10 s (the listener's drain)")
        return self


class KubernetesConfig(Strict):
    """What `serving render-k8s` writes into the overlay besides the Serve config."""

    image: str = Field(
        "ghcr.io/raystack/raystack-llm:0.1.0-ray2.60.0",
        description="Image of every Ray pod (serving and training): `repo:tag`, `repo@sha256:<digest>` or "
        "`repo:tag@sha256:<digest>`. Pin production by digest (docs/operations.md).",
    )

    @field_validator("image")
    @classmethod
    def _image_ref(cls, v: str) -> str:
        m = IMAGE_RE.match(v)
        if not m or not (m["tag"] or m["digest"]):
            raise ValueError("image must be repo:tag, repo@sha256:<64 hex> or repo:tag@sha256:<64 hex>")
        return v


class ControllerConfig(Strict):
    """The promotion controller: one Serve application per stack (docs/operations.md)."""

    enabled: bool = Field(True, description="Deploy the controller application with the stack.")
    poll_s: float = Field(2.0, gt=0, le=300, description="How often it reads the store and judges the canaries.")
    lock_ttl_s: float = Field(
        30, ge=5, le=3600, description="Lease of the store lock; a controller that stops renewing loses it after this."
    )
    target: Literal["local", "kubernetes"] = Field(
        "local",
        description="local: steps are applied through Serve; kubernetes: as a patch of the RayService's "
        "serveConfigV2 (render-k8s sets this).",
    )
    client_key_env: str | None = Field(
        None, description="Env var with the API key the controller warms and evaluates new versions with."
    )
    gateway_url: str | None = Field(
        None, description="Where the controller reaches the gateway (default: its host:port)."
    )
    admin_key_hashes: list[str] = Field(
        default_factory=list,
        description="Salted hashes (`serving keys new`) of the admin keys that may read `GET /admin/promotions` "
        "on the gateway; no tenant key can. Without an admin key the route answers 404.",
    )
    admin_key_env: str | None = Field(
        None,
        description="Environment variable holding an admin key (e.g. from a K8s Secret); not a tenant's "
        "key_env nor client_key_env.",
    )
    admin_timeout_s: float = Field(
        5.0, gt=0, le=60, description="Longest wait of `GET /admin/promotions` for the store; then 503."
    )

    @field_validator("admin_key_hashes")
    @classmethod
    def _admin_hash_format(cls, v: list[str]) -> list[str]:
        return check_key_hashes(v)

    @model_validator(mode="after")
    def _admin_key_apart(self) -> ControllerConfig:
        if self.admin_key_env and self.admin_key_env == self.client_key_env:
            raise ValueError(
                f"admin_key_env and client_key_env are both {self.admin_key_env!r}: the admin key must be "
                "no client's key (client_key_env is a tenant's key)"
            )
        return self

    @property
    def has_admin_key(self) -> bool:
        return bool(self.admin_key_hashes or self.admin_key_env)
