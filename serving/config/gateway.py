"""The gateway's part of the stack config (the OpenAI-compatible ingress and its Responses store)
and the tenants with their keys and limits."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from serving.config.base import Strict, check_key_hashes, check_model_name
from serving.config.model import AutoscalingConfig

__all__ = ["AuthConfig", "GatewayConfig", "ResponseStoreConfig", "TenantConfig"]


class ResponseStoreConfig(Strict):
    """The gateway's store of Responses API responses (`store: true`), per tenant."""

    ttl_s: float = Field(86400, gt=0, description="A stored response is kept this long after it is written.")
    max_per_tenant: int = Field(1000, ge=1, description="Stored responses per tenant; beyond it the oldest go.")
    max_bytes_per_tenant: int = Field(
        64 * 1024 * 1024, ge=1024, description="Bytes of stored responses per tenant; beyond it the oldest go."
    )
    max_response_bytes: int = Field(
        1024 * 1024, ge=1024, description="A response (with its conversation) larger than this is not stored."
    )
    timeout_s: float = Field(2.0, gt=0, le=60, description="Longest wait for the store's answer; then 503.")

    @model_validator(mode="after")
    def _one_fits(self) -> ResponseStoreConfig:
        if self.max_response_bytes > self.max_bytes_per_tenant:
            raise ValueError(
                f"max_response_bytes ({self.max_response_bytes}) is over max_bytes_per_tenant "
                f"({self.max_bytes_per_tenant}): one response could not be kept without evicting every other"
            )
        return self


class GatewayConfig(Strict):
    """The OpenAI-compatible ingress."""

    host: str = Field("127.0.0.1", description="Bind address (0.0.0.0 on Kubernetes).")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port of the OpenAI API.")
    ingress: Literal["listener", "serve_proxy"] = Field(
        "listener",
        description="listener: each gateway replica serves `port` itself (SO_REUSEPORT), one Python hop "
        "per token; serve_proxy: Ray Serve's HTTP proxy serves `port` (slower, docs/performance.md).",
    )
    proxy_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Port of Ray Serve's own HTTP proxy when ingress is listener (health only); default port+1.",
    )
    replica_routing: Literal["direct", "serve"] = Field(
        "direct",
        description="direct: the gateway picks model replicas itself from their published endpoints "
        "(power of two choices, no Ray call per request); serve: one Serve lease call per request. "
        "Prefix/session affinity and cold starts always use Serve.",
    )
    num_replicas: int = Field(1, ge=1, description="Fixed gateway replicas (ignored if autoscaling).")
    autoscaling: AutoscalingConfig | None = Field(
        None,
        description="Scale gateway replicas on their own in-flight requests (min_replicas at least 1 with "
        "ingress listener).",
    )
    num_cpus: float = Field(0.5, gt=0, description="Logical CPUs reserved per gateway replica.")
    max_body_bytes: int = Field(1_048_576, ge=1024, description="Larger request bodies get 413.")
    retries: int = Field(
        2,
        ge=0,
        le=10,
        description="Retries on another replica, only of failures safe to resend: connection refused or "
        "reset before any response byte, replica dead (lease died, vLLM 503), first_byte_timeout_s passed.",
    )
    max_migrations: int = Field(
        1,
        ge=0,
        le=4,
        description="Times one stream may be continued on another replica of the same version after its replica "
        'died mid-answer (docs/architecture.md, "Stream migration"); 0: such a stream ends with an error event.',
    )
    prefix_cache_scope: Literal["tenant", "shared"] = Field(
        "tenant",
        description="tenant: the gateway sets vLLM's cache_salt of every generating or embedding request from its "
        "tenant (and the client's own cache_salt), so the engines never reuse one tenant's cached prompt blocks for "
        "another tenant's request and time to first token tells nothing about other tenants' prompts; shared: "
        "tenants share cached prefixes (a system prompt many tenants send is computed once) and a client's "
        "cache_salt is passed on as sent.",
    )
    retry_budget_ratio: float = Field(
        0.2, ge=0, le=10, description="Retries allowed per request over the last 10 s (plus retry_budget_min)."
    )
    retry_budget_min: int = Field(10, ge=0, description="Retries per 10 s always allowed, whatever the traffic.")
    first_byte_timeout_s: float = Field(
        300,
        gt=0,
        description="Per try: longest wait for a replica's first byte (for a non-streamed request, the whole "
        "answer); then the try is abandoned and retried elsewhere.",
    )
    upstream_timeout_s: float = Field(600, gt=0, description="Longest wait between two bytes of a replica's answer.")
    max_upstream_connections: int = Field(
        1024, ge=1, description="Requests one gateway replica has open to model replicas at once."
    )
    upstream_pool_wait_s: float = Field(
        10, gt=0, description="Longest wait for a free upstream connection; then 503 (the replica is not blamed)."
    )
    header_timeout_s: float = Field(
        10,
        gt=0,
        description="(ingress listener) A client must send a request's headers within this from its first byte; "
        "then 408.",
    )
    body_timeout_s: float = Field(
        30, gt=0, description="(ingress listener) ...and its body within this after the headers; then 408."
    )
    keep_alive_s: int = Field(
        60, ge=1, description="(ingress listener) An idle client connection is closed after this."
    )
    max_client_connections: int = Field(
        4096,
        ge=1,
        description=(
            "(ingress listener) Open client connections per gateway replica; beyond them: 503 on the request"
            " line (Anthropic's error shape on `/v1/messages`)."
        ),
    )
    max_n: int = Field(8, ge=1, le=128, description="Largest `n` (choices per request); larger gets 400.")
    default_model: str | None = Field(None, description="Model used when a request names none.")
    responses: ResponseStoreConfig = Field(
        default_factory=ResponseStoreConfig, description="Where `store: true` Responses are kept, and how long."
    )
    expose_replica_header: bool = Field(
        False,
        description="Add x-replica (the serving replica), x-replica-route (direct | serve), x-upstream-attempts and "
        "x-gateway-replica to responses; for debugging.",
    )

    @model_validator(mode="after")
    def _ports(self) -> GatewayConfig:
        if self.ingress == "listener" and self.serve_proxy_port == self.port:
            raise ValueError("proxy_port must differ from port (the gateway replicas listen on port)")
        if self.ingress == "listener" and self.autoscaling and self.autoscaling.min_replicas < 1:
            raise ValueError(
                "autoscaling.min_replicas must be at least 1 with ingress listener: the gateway replicas "
                "listen on port themselves, so with none running nothing accepts connections"
            )
        return self

    @property
    def serve_proxy_port(self) -> int:
        """Where Ray Serve's HTTP proxy listens."""
        if self.ingress == "serve_proxy":
            return self.port
        return self.proxy_port or (self.port + 1 if self.port < 65535 else self.port - 1)


class TenantConfig(Strict):
    """A client team: its API keys (never in plain text here), models, limits and priority."""

    name: str = Field(description="Tenant id (a metrics label).")
    key_hashes: list[str] = Field(
        default_factory=list, description="Salted hashes from `serving keys new` (sha256$salt$hex)."
    )
    key_env: str | None = Field(
        None, description="Environment variable holding the tenant's key (e.g. from a K8s Secret)."
    )
    models: list[str] = Field(default_factory=lambda: ["*"], description="Allowed models; * = all.")
    rpm: int | None = Field(None, ge=1, description="Requests per window (None = unlimited).")
    tpm: int | None = Field(None, ge=1, description="Prompt + completion tokens per window.")
    priority: int = Field(5, ge=0, le=9, description="Below 5: shed first when a model is busy.")
    max_streams: int | None = Field(
        None, ge=1, description="Streams in progress at once, across gateway replicas; beyond: 429 (None = no cap)."
    )

    @field_validator("name")
    @classmethod
    def _tenant_name(cls, v: str) -> str:
        return check_model_name(v)

    @field_validator("key_hashes")
    @classmethod
    def _hash_format(cls, v: list[str]) -> list[str]:
        return check_key_hashes(v)

    @model_validator(mode="after")
    def _has_key(self) -> TenantConfig:
        if not self.key_hashes and not self.key_env:
            raise ValueError("a tenant needs key_hashes or key_env")
        return self


class AuthConfig(Strict):
    """API keys and quotas. ``mode: open`` (no keys) is for local development only, and loud."""

    mode: Literal["keys", "open"] = Field("keys", description="keys: API keys required; open: none (dev).")
    tenants: list[TenantConfig] = Field(default_factory=list, description="Client teams and their keys.")
    window_s: float = Field(60, gt=0, description="Rate-limit window (RPM/TPM are per window).")
    quota_timeout_s: float = Field(2.0, gt=0, le=60, description="Longest wait for the quota actor's admission answer.")
    quota_failure_mode: Literal["open", "closed"] = Field(
        "open",
        description="When the quota actor does not answer in time: open admits the request unchecked "
        "(logged), closed refuses it with 503 and Retry-After.",
    )

    @model_validator(mode="after")
    def _tenants(self) -> AuthConfig:
        if self.mode == "keys" and not self.tenants:
            raise ValueError("mode 'keys' needs at least one tenant (or set mode: open)")
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate tenant name in {names}")
        # one key, one tenant: a key shared by two would authenticate as either of them
        env_of: dict[str, str] = {}
        hash_of: dict[str, str] = {}
        for t in self.tenants:
            if t.key_env and env_of.setdefault(t.key_env, t.name) != t.name:
                raise ValueError(
                    f"tenants {env_of[t.key_env]!r} and {t.name!r} both have key_env {t.key_env!r}: "
                    "each tenant needs keys of its own"
                )
            for h in t.key_hashes:
                if hash_of.setdefault(h, t.name) != t.name:
                    raise ValueError(
                        f"tenants {hash_of[h]!r} and {t.name!r} both list the key hash {h!r} in key_hashes: "
                        "each tenant needs keys of its own"
                    )
        return self
