"""One model of the stack config: its versions (and the recipes that build them), its vLLM engine,
its Serve deployment, its LoRA slots and its promotion policy."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from serving.config.base import DEFAULT_LORA_RANK, VERSION_RE, Strict, check_model_name
from serving.registry import Gate

__all__ = [
    "AdapterRouting",
    "AutoscalingConfig",
    "DeploymentOptions",
    "EngineConfig",
    "LoraSlots",
    "ModelConfig",
    "ModelVersion",
    "OnlineEval",
    "PromotionPolicy",
    "RouterName",
    "RunnerName",
    "TrainRecipe",
]

RunnerName = Literal["generate", "pooling"]
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


_WEIGHTS = "the stack passes vLLM only the version's verified files"
_PORT = "the stack binds the engine to its node's Ray address, every route behind its token"
_LOGS = "prompt and answer text stays out of the logs"
# vLLM flags the stack sets itself, each for a guarantee an ``extra_args`` entry would undo
_STACK_FLAGS = {
    "model": _WEIGHTS,
    "tokenizer": _WEIGHTS,
    "lora-modules": _WEIGHTS + " (adapters are models of their own, with a base)",
    "served-model-name": "the stack names the model as the gateway routes it",
    "host": _PORT,
    "port": _PORT,
    "middleware": _PORT,
    "api-key": _PORT + " (a key here would also show on the command line)",
    "kv-events-config": _PORT + " (the events carry prompt tokens; router kv_aware sets a local socket)",
    "enable-log-requests": _LOGS,
    "enable-log-outputs": _LOGS,
}


class EngineConfig(Strict):
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
        description="Further vLLM CLI flags, e.g. {enforce-eager: true}; booleans become bare flags. Flags the "
        "stack sets itself are refused: model, tokenizer, lora-modules, served-model-name, host, port, "
        "middleware, api-key, kv-events-config, enable-log-requests, enable-log-outputs.",
    )

    @model_validator(mode="after")
    def _runner(self) -> EngineConfig:
        for key in self.extra_args:
            flag = key.replace("_", "-").removeprefix("--")
            # the gateway decides what a model may answer from ``runner``: no second spelling of it
            if flag in ("runner", "convert", "task"):
                raise ValueError(f"extra_args must not set {key!r}; use the runner field")
            if flag in _STACK_FLAGS:  # vLLM takes the last of two flags: these would win over the stack's
                raise ValueError(f"extra_args must not set {key!r}: {_STACK_FLAGS[flag]}")
        if self.runner == "pooling" and self.tool_call_parser:
            raise ValueError("tool_call_parser needs runner generate (a pooling model makes no tool calls)")
        return self


class AutoscalingConfig(Strict):
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


class DeploymentOptions(Strict):
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


class TrainRecipe(Strict):
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
        description="full: every weight is trained; lora (for a model entry with `base` set): a peft adapter of "
        "`base`, <that entry's base>@<a version of it this config serves>, of a `lora_rank` up to that base's "
        "lora.max_lora_rank.",
    )
    steps: int | None = Field(None, ge=1, description="Optimizer steps; default: the job's default for the base.")
    seed: int = Field(0, description="Data order and initialisation seed.")
    lora_rank: int | None = Field(
        None, ge=1, description=f"method lora: the adapter's rank (default {DEFAULT_LORA_RANK})."
    )
    lora_alpha: int | None = Field(None, ge=1, description="method lora: its scaling alpha (default 16).")

    @model_validator(mode="after")
    def _lora_only(self) -> TrainRecipe:
        if self.method != "lora" and (self.lora_rank or self.lora_alpha):
            raise ValueError("lora_rank and lora_alpha need method lora")
        return self


class ModelVersion(Strict):
    """One servable version of a model: its weights and its share of the model's traffic."""

    version: str = Field(description="Version name (a folder of the checkpoint store).")
    path: str | None = Field(
        None,
        description="Checkpoint directory; default <checkpoint_root>/<model>/<version>. It may be another "
        "version's (the same checkpoint under another name; serving up builds the versions with a recipe first).",
    )
    weight: int = Field(100, ge=0, le=100, description="Percent of the bare model name's traffic.")
    recipe: TrainRecipe | None = Field(None, description="Train this version if it is missing.")
    manifest_sha256: str | None = Field(
        None,
        description="sha256 of the version's manifest.json (`serving versions` prints it): its replicas refuse "
        "a manifest with other bytes, so a version replaced in the store, files and manifest together, is not "
        "served. The promotion controller pins every version it promotes itself (live.json).",
    )

    @field_validator("version")
    @classmethod
    def _version_name(cls, v: str) -> str:
        if not VERSION_RE.match(v):
            raise ValueError("version must be 1-31 chars of letters, digits, '.', '_' or '-'")
        return v

    @field_validator("manifest_sha256")
    @classmethod
    def _sha256(cls, v: str | None) -> str | None:
        if v is not None and not SHA256_RE.match(v):
            raise ValueError("manifest_sha256 must be 64 lowercase hex digits")
        return v


class OnlineEval(Strict):
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


class PromotionPolicy(Strict):
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
        description="A step short of min_requests, overloaded, or with a node whose metrics were not read at both "
        "ends of its window is extended this many times, then rolled back.",
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


class LoraSlots(Strict):
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


class ModelConfig(Strict):
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

    @field_validator("name", "aliases")
    @classmethod
    def _names(cls, v: str | list[str]) -> str | list[str]:
        """A name and its aliases alike: clients send either in `model`."""
        return check_model_name(v) if isinstance(v, str) else [check_model_name(a, f"alias {a!r}") for a in v]

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
