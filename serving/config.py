"""The stack config: one YAML file per environment, validated here, used everywhere.

One config, one path: ``deployments/<env>.yaml`` -> :class:`StackConfig` -> the Serve config
(:mod:`serving.control.serve_config`) that runs locally *and* is rendered into the RayService ``serveConfigV2``.
Every model rejects unknown fields, so a typo fails loudly with the file and field named.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from serving.registry import Gate

__all__ = [
    "AuthConfig",
    "TenantConfig",
    "AutoscalingConfig",
    "ConfigError",
    "ControllerConfig",
    "OnlineEval",
    "PromotionPolicy",
    "DeploymentOptions",
    "EngineConfig",
    "LoraSlots",
    "GatewayConfig",
    "KubernetesConfig",
    "LOCAL_RAY_LOOPBACK",
    "LocalRayConfig",
    "ShutdownConfig",
    "ModelConfig",
    "ModelVersion",
    "StackConfig",
    "TrainRecipe",
    "load_config",
]

NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$")


def _check_name(v: str) -> str:
    """Model and tenant names: they become Serve app names, metric labels and K8s-safe ids."""
    if not NAME_RE.match(v):
        raise ValueError("name must be 1-40 chars of lower-case letters, digits and '-'")
    return v


# registry/repository, then :tag and/or @sha256:digest (at least one)
IMAGE_RE = re.compile(
    r"^(?P<repo>[a-z0-9]+(?:[._-][a-z0-9]+)*(?::[0-9]+)?(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*)"
    r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?(?:@(?P<digest>sha256:[0-9a-f]{64}))?$"
)
VERSION_RE = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9._-]{0,30}$")


class ConfigError(ValueError):
    """A stack config file is missing, not YAML, or fails validation (message names file and field)."""


class _Strict(BaseModel):
    # validate_default: a float field's default 600 becomes 600.0 like a parsed "600" does, so a
    # config and its re-validated copy (promotions) give byte-identical Serve configs; otherwise
    # Serve sees changed app args and restarts the gateway instead of reconfiguring it in place
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


RunnerName = Literal["generate", "pooling"]


class EngineConfig(_Strict):
    """vLLM engine arguments for one model. Known fields are typed; the rest go in ``extra_args``."""

    runner: RunnerName = Field(
        "generate",
        description="vLLM's --runner. generate: chat and completions; pooling: an embedding model, "
        "/v1/embeddings only. The gateway answers a request of the other kind with 400 itself.",
    )
    max_model_len: int = Field(256, ge=8, description="Context length (prompt + completion tokens).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights and activations dtype."
    )
    max_num_seqs: int = Field(64, ge=1, description="Sequences batched at once per replica.")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="Ranks per replica that split each layer.")
    pipeline_parallel_size: int = Field(1, ge=1, le=64, description="Pipeline stages per replica.")
    enable_prefix_caching: bool = Field(
        True,
        description="Reuse KV cache of shared prompt prefixes (runner generate; a pooling model gets vLLM's "
        "own choice, off for bidirectional attention).",
    )
    seed: int = Field(0, description="Engine seed (requests may set their own `seed`).")
    kv_cache_space_gib: int = Field(1, ge=1, description="CPU only: KV-cache size in GiB (VLLM_CPU_KVCACHE_SPACE).")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="GPU only.")
    pin_cores: bool = Field(
        True,
        description="CPU, one rank: EngineCore on its own claimed core(s), vLLM's API server on the node's "
        "unclaimed cores, if any (docs/performance.md).",
    )
    tool_call_parser: str | None = Field(
        None,
        description="vLLM tool-call parser for the model's format (e.g. hermes): enables tool_choice auto.",
    )
    extra_args: dict[str, str | int | float | bool] = Field(
        default_factory=dict,
        description="Further vLLM CLI flags, e.g. {enforce-eager: true}; booleans become bare flags.",
    )

    @model_validator(mode="after")
    def _runner(self) -> EngineConfig:
        # the gateway decides what a model may answer from ``runner``: no second spelling of it
        for key in self.extra_args:
            if key.replace("_", "-") in ("runner", "convert", "task"):
                raise ValueError(f"extra_args must not set {key!r}; use the runner field")
        if self.runner == "pooling" and self.tool_call_parser:
            raise ValueError("tool_call_parser needs runner generate (a pooling model makes no tool calls)")
        return self


class AutoscalingConfig(_Strict):
    """Ray Serve autoscaling for one model's deployment; defaults that really scale."""

    min_replicas: int = Field(1, ge=0, description="0 allows scale to zero (cold start on first request).")
    max_replicas: int = Field(1, ge=1, description="Upper bound of replicas.")
    initial_replicas: int | None = Field(None, ge=0, description="Replicas at deploy time (default min).")
    target_ongoing_requests: float = Field(
        8, gt=0, description="Concurrent requests per replica the autoscaler aims for."
    )
    upscale_delay_s: float = Field(10, ge=0, description="Load must stay high this long before adding.")
    downscale_delay_s: float = Field(60, ge=0, description="Load must stay low this long before removing.")
    metrics_interval_s: float = Field(2, gt=0, description="How often replicas report their load.")
    look_back_period_s: float = Field(10, gt=0, description="Window the load is averaged over.")

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must be <= max_replicas")
        init = self.initial_replicas
        if init is not None and not self.min_replicas <= init <= self.max_replicas:
            raise ValueError("initial_replicas must lie between min_replicas and max_replicas")
        return self


RouterName = Literal["power_of_two", "prefix_affinity", "session_affinity", "kv_aware"]
AdapterRouting = Literal["loaded_first", "power_of_two"]


class DeploymentOptions(_Strict):
    """How a model's replicas are run by Ray Serve."""

    num_replicas: int = Field(1, ge=1, description="Fixed replica count (ignored if autoscaling).")
    autoscaling: AutoscalingConfig | None = Field(None, description="If set, replaces num_replicas.")
    max_ongoing_requests: int = Field(
        64, ge=1, description="In-flight requests one replica gets (per gateway replica when picked directly)."
    )
    max_queued_requests: int = Field(
        256, ge=1, description="Requests waiting per gateway for a replica; beyond that: 503 with Retry-After."
    )
    router: RouterName = Field(
        "power_of_two",
        description="Replica choice: power_of_two, prefix_affinity, session_affinity or kv_aware (the replica "
        "whose engine reports the longest cached prefix of the request's tokens, traded off against load).",
    )
    cpus_per_rank: float = Field(1.0, gt=0, description="CPU reserved per TP/PP rank.")
    gpus_per_rank: float = Field(0.0, ge=0, description="GPUs per rank (0 = CPU engine).")
    startup_timeout_s: float = Field(600, gt=0, description="Engine start before the replica fails.")
    stall_timeout_s: float = Field(
        30,
        gt=0,
        description="An engine holding requests that generates and prefills no token this long is hung: "
        "its replica fails its health check and is replaced; its unanswered requests go elsewhere.",
    )
    cold_start_timeout_s: float = Field(
        120, gt=0, description="How long a request waits for a replica of a scaled-to-zero model."
    )


class TrainRecipe(_Strict):
    """How ``serving up`` builds a missing version with the training job: the same arguments as
    ``python -m training.train`` (docs/training.md)."""

    base: str = Field(
        description="Where the weights start: init:<family>-<size> (freshly built, e.g. init:llama-tiny), "
        "<model>@<version> of the store, a Hugging Face folder, an fsspec URI of one, or a hub id."
    )
    data: str = Field(description="Training JSONL (path or fsspec URI), or builtin:<task> (generated).")
    eval: str | None = Field(None, description="Evaluation JSONL; default: the held-out half of builtin:<task>.")
    method: Literal["full", "lora"] = Field(
        "full",
        description="full: every weight is trained; lora: a peft adapter of `base` (a store `model@version`), "
        "for a model entry with `base` set.",
    )
    steps: int | None = Field(None, ge=1, description="Optimizer steps; default: the job's default for the base.")
    seed: int = Field(0, description="Data order and initialisation seed.")
    lora_rank: int | None = Field(None, ge=1, description="method lora: the adapter's rank (default 8).")
    lora_alpha: int | None = Field(None, ge=1, description="method lora: its scaling alpha (default 16).")

    @model_validator(mode="after")
    def _lora_only(self) -> TrainRecipe:
        if self.method != "lora" and (self.lora_rank or self.lora_alpha):
            raise ValueError("lora_rank and lora_alpha need method lora")
        return self


class ModelVersion(_Strict):
    """One servable version of a model: its weights and its share of the model's traffic."""

    version: str = Field(description="Version name (a folder of the checkpoint store).")
    path: str | None = Field(
        None,
        description="Checkpoint directory; default <checkpoint_root>/<model>/<version>. It may be another "
        "version's (the same checkpoint under another name; serving up builds the versions with a recipe first).",
    )
    weight: int = Field(100, ge=0, le=100, description="Percent of the bare model name's traffic.")
    recipe: TrainRecipe | None = Field(None, description="Train this version if it is missing.")

    @field_validator("version")
    @classmethod
    def _version_name(cls, v: str) -> str:
        if not VERSION_RE.match(v):
            raise ValueError("version must be 1-31 chars of letters, digits, '.', '_' or '-'")
        return v


class OnlineEval(_Strict):
    """Held-out eval prompts sent to ``model@new`` during the canary (errors and latency cannot
    see a model that answers worse)."""

    samples: int = Field(20, ge=0, description="Eval rows sent per canary step (0 = no online eval).")
    margin: float = Field(
        0.1, ge=0, le=1, description="Roll back when the online exact match is below the manifest's by more."
    )
    metric: str = Field(
        "exact_match",
        description="The manifest's eval metric the online score is compared to: exact_match (higher is "
        "better, as the online score is an exact match over the eval file's rows).",
    )

    @field_validator("metric")
    @classmethod
    def _comparable(cls, v: str) -> str:
        if v != "exact_match":
            raise ValueError(
                f"online_eval.metric {v!r}: the online score is an exact match over all the eval rows, so only "
                "the manifest's exact_match compares with it (a loss or a per-kind score does not)"
            )
        return v


class PromotionPolicy(_Strict):
    """How the promotion controller canaries a new version of this model (docs/operations.md)."""

    mode: Literal["manual", "auto"] = Field(
        "manual",
        description="auto: a newer version in the store that passes hashes and the gate is promoted by the "
        "controller; manual: it waits for `serving promote MODEL VERSION`.",
    )
    steps: list[int] = Field(default_factory=lambda: [10, 50, 100], description="Traffic % of the new version.")
    step_seconds: float = Field(30, gt=0, description="How long each step is watched.")
    min_requests: int = Field(
        5, ge=1, description="Requests the new version must answer in a step before it is judged."
    )
    max_step_extensions: int = Field(
        3,
        ge=0,
        description="A step short of min_requests (or overloaded) is extended this many times, then rolled back.",
    )
    max_error_rate_increase: float = Field(0.02, ge=0, le=1, description="New error rate allowed above the live one.")
    max_ttft_ratio: float = Field(2.0, gt=1, description="New TTFT percentile allowed, times the live one's...")
    ttft_slack_s: float = Field(0.05, ge=0, description="...plus this.")
    ttft_percentiles: list[float] = Field(
        default_factory=lambda: [0.5, 0.95], description="TTFT percentiles compared (from the histograms)."
    )
    warmup_requests: int = Field(3, ge=0, description="Requests sent to model@new before it gets traffic.")
    deploy_timeout_s: float = Field(600, gt=0, description="The new version's app must be RUNNING within this.")
    drain_seconds: float = Field(5, ge=0, description="The old version gets no traffic this long before removal.")
    online_eval: OnlineEval = Field(OnlineEval(), description="Held-out prompts sent to model@new per step.")

    @field_validator("steps")
    @classmethod
    def _steps(cls, v: list[int]) -> list[int]:
        if not v or v[-1] != 100 or any(not 0 < w <= 100 for w in v) or v != sorted(set(v)):
            raise ValueError("steps rise strictly from above 0 and end at 100, e.g. [10, 50, 100]")
        return v

    @field_validator("ttft_percentiles")
    @classmethod
    def _percentiles(cls, v: list[float]) -> list[float]:
        if any(not 0 < q < 1 for q in v):
            raise ValueError("percentiles lie between 0 and 1 (0.5 is the median)")
        return v


# the ranks vLLM's --max-lora-rank accepts
LoraRank = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512]


class LoraSlots(_Strict):
    """A base model's LoRA settings: vLLM start-time flags, fixed when the base is deployed, so
    that adding or promoting an adapter later restarts nothing (docs/adapters.md)."""

    max_loras: int = Field(2, ge=1, le=64, description="Adapters in one batch (vLLM --max-loras).")
    max_cpu_loras: int = Field(
        4,
        ge=1,
        le=256,
        description="Adapters registered on one replica at once, kept in its CPU-side cache (vLLM "
        "--max-cpu-loras); the least recently used one is unregistered to make room.",
    )
    max_lora_rank: LoraRank = Field(16, description="Largest adapter rank served (vLLM --max-lora-rank).")

    @model_validator(mode="after")
    def _cache(self) -> LoraSlots:
        if self.max_cpu_loras < self.max_loras:
            raise ValueError("max_cpu_loras must be at least max_loras")
        return self


class ModelConfig(_Strict):
    """One model: its versions (one Serve deployment each), aliases, engine and deployment options.
    With ``base`` set, a LoRA adapter of that model: its versions are registered on the base's
    replicas (no deployment of their own), and ``engine``/``deployment``/``lora`` are the base's."""

    name: str = Field(description="Model id clients send in `model`.")
    aliases: list[str] = Field(default_factory=list, description="Other names that route to this model.")
    versions: list[ModelVersion] = Field(min_length=1, description="Deployed versions and their weights.")
    base: str | None = Field(
        None,
        description="Adapter: the model whose replicas serve it. Each version runs on the base version its "
        "manifest names (the one it was trained on), registered as `name@version`.",
    )
    adapter_routing: AdapterRouting = Field(
        "loaded_first",
        description="Adapter only. loaded_first: a base replica that holds the adapter, then the one with the "
        "fewest adapters; power_of_two: any base replica (Serve's router), registering it there if needed.",
    )
    lora: LoraSlots | None = Field(
        None, description="Base only: LoRA slots of its replicas; default {} when an adapter names it."
    )
    engine: EngineConfig = Field(EngineConfig(), description="vLLM engine arguments.")
    deployment: DeploymentOptions = Field(DeploymentOptions(), description="Ray Serve options.")
    gate: Gate | None = Field(
        None,
        description="What a version's manifest must score to be promoted, e.g. {metric: exact_match, min: 0.9}.",
    )
    promotion: PromotionPolicy = Field(PromotionPolicy(), description="How new versions are canaried.")

    @field_validator("name")
    @classmethod
    def _model_name(cls, v: str) -> str:
        return _check_name(v)

    @model_validator(mode="after")
    def _adapter(self) -> ModelConfig:
        if self.base is None:
            if any(v.recipe and v.recipe.method == "lora" for v in self.versions):
                raise ValueError("a recipe with method lora belongs to an adapter entry (set base)")
            return self
        # compared with the defaults, not by which fields were set: a dumped config validates again
        theirs = [k for k, v in (("engine", EngineConfig()), ("deployment", DeploymentOptions()), ("lora", None))
                  if getattr(self, k) != v]  # fmt: skip
        if theirs:
            raise ValueError(f"an adapter has its base's {theirs}: set them on {self.base!r}")
        if any(v.recipe and v.recipe.method != "lora" for v in self.versions):
            raise ValueError("an adapter's recipes train with method lora")
        return self

    @model_validator(mode="after")
    def _kv_aware(self) -> ModelConfig:
        if self.deployment.router == "kv_aware":
            if self.engine.runner != "generate":
                raise ValueError("router kv_aware routes by prompt blocks: a generate model only")
            if not self.engine.enable_prefix_caching:
                raise ValueError("router kv_aware needs engine.enable_prefix_caching")
        return self

    @model_validator(mode="after")
    def _weights(self) -> ModelConfig:
        names = [v.version for v in self.versions]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate version in {names}")
        if sum(v.weight for v in self.versions) != 100:
            raise ValueError("the weights of a model's versions must add up to 100")
        return self

    def version(self, version: str) -> ModelVersion | None:
        return next((v for v in self.versions if v.version == version), None)

    @property
    def is_adapter(self) -> bool:
        return self.base is not None

    @property
    def live_version(self) -> str:
        """The version with the largest share of traffic (first on ties)."""
        return max(self.versions, key=lambda v: v.weight).version


class ResponseStoreConfig(_Strict):
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


class GatewayConfig(_Strict):
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
        None, description="Scale gateway replicas on their own in-flight requests."
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
        return self

    @property
    def serve_proxy_port(self) -> int:
        """Where Ray Serve's HTTP proxy listens."""
        if self.ingress == "serve_proxy":
            return self.port
        return self.proxy_port or (self.port + 1 if self.port < 65535 else self.port - 1)


def _check_key_hashes(v: list[str]) -> list[str]:
    for h in v:
        parts = h.split("$")
        if len(parts) != 3 or parts[0] != "sha256" or len(parts[2]) != 64:
            raise ValueError("key hashes look like sha256$<salt>$<64 hex> (serving keys new)")
    return v


class TenantConfig(_Strict):
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
        return _check_name(v)

    @field_validator("key_hashes")
    @classmethod
    def _hash_format(cls, v: list[str]) -> list[str]:
        return _check_key_hashes(v)

    @model_validator(mode="after")
    def _has_key(self) -> TenantConfig:
        if not self.key_hashes and not self.key_env:
            raise ValueError("a tenant needs key_hashes or key_env")
        return self


class AuthConfig(_Strict):
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
        return self


class LocalRayConfig(_Strict):
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
# 127.0.0.1.
LOCAL_RAY_LOOPBACK: dict[str, str] = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


class ShutdownConfig(_Strict):
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


class KubernetesConfig(_Strict):
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


class ControllerConfig(_Strict):
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
        None, description="Environment variable holding an admin key (e.g. from a K8s Secret)."
    )
    admin_timeout_s: float = Field(
        5.0, gt=0, le=60, description="Longest wait of `GET /admin/promotions` for the store; then 503."
    )

    @field_validator("admin_key_hashes")
    @classmethod
    def _admin_hash_format(cls, v: list[str]) -> list[str]:
        return _check_key_hashes(v)

    @property
    def has_admin_key(self) -> bool:
        return bool(self.admin_key_hashes or self.admin_key_env)


class StackConfig(_Strict):
    """A whole environment: gateway plus models."""

    name: str = Field("local", description="Stack name: local state in .run/<name>.*.")
    checkpoint_root: str = Field("checkpoints", description="Local path or fsspec URI.")
    gateway: GatewayConfig = Field(GatewayConfig(), description="The OpenAI-compatible ingress.")
    auth: AuthConfig = Field(description="Required: keys and tenants, or an explicit `mode: open`.")
    local_ray: LocalRayConfig = Field(LocalRayConfig(), description="Only for `serving up`.")
    shutdown: ShutdownConfig = Field(ShutdownConfig(), description="Draining budget of stopping replicas.")
    kubernetes: KubernetesConfig = Field(KubernetesConfig(), description="Only for `serving render-k8s`.")
    controller: ControllerConfig = Field(ControllerConfig(), description="The promotion controller.")
    models: list[ModelConfig] = Field(min_length=1, description="Models served at the same time.")

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


def _where(loc: tuple[int | str, ...], data: object) -> str:
    """Turn a pydantic location into ``models[adder].engine.dtype`` using model names."""
    parts: list[str] = []
    node = data
    for item in loc:
        if isinstance(item, int) and isinstance(node, list):
            entry = node[item] if item < len(node) else None
            label = entry.get("name") or entry.get("version") if isinstance(entry, dict) else None
            parts[-1] += f"[{label or item}]"
            node = entry
        else:
            parts.append(str(item))
            node = node.get(item) if isinstance(node, dict) else None
    return ".".join(parts) or "(top level)"


def validation_message(source: str, what: str, exc: ValidationError, data: object) -> str:
    """One line per failing field, each located as ``models[adder].engine.dtype`` (list items by
    their ``name``/``version`` where they have one); shared by every YAML file the project reads."""
    lines = [f"{source}: invalid {what}:"]
    lines += [f"  {_where(err['loc'], data)}: {err['msg']}" for err in exc.errors()]
    return "\n".join(lines)


def read_yaml(path: Path, error: type[Exception], missing: str) -> object:
    """The parsed YAML of ``path``; a missing file or bad YAML raise ``error`` naming the file."""
    try:
        return yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise error(f"{path}: {missing}") from None
    except yaml.YAMLError as exc:
        raise error(f"{path}: not valid YAML: {exc}") from None


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
