"""Engine options: the stack config's model section -> vLLM server command line and environment.

Pure functions, no Ray or vLLM import, so they are unit-tested and reused by the renderer.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from serving.config import ConfigError, EngineConfig, ModelConfig

__all__ = [
    "EngineSpec",
    "check_layout",
    "claim_cores",
    "claimed_cores",
    "cpu_bind_groups",
    "engine_core_pid",
    "pid_alive",
    "pin_single_process",
    "single_process",
    "spare_cores",
    "vllm_command",
    "engine_environ",
    "vllm_env",
]

# Node-local record of which cores each CPU engine is bound to (tmpfs: gone at reboot, per pod on K8s)
CORE_LEDGER = Path(os.environ.get("RAYSTACK_CORE_LEDGER", "/dev/shm/raystack-engine-cores.json"))


class EngineSpec(BaseModel):
    """Everything a replica needs to start its engine; JSON-able so it travels in a Serve config."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    version: str
    path: str
    engine: EngineConfig
    use_gpu: bool = False
    gpus_per_rank: float = 0.0
    cpus_per_rank: float = 1.0
    startup_timeout_s: float = 600
    stall_timeout_s: float = 30
    shutdown_grace_s: float = 60  # Serve's graceful_shutdown_timeout_s: the replica's drain fits in it
    secret_env: list[str] = []  # variables the engine must not inherit (the tenants' key_env)

    @property
    def world_size(self) -> int:
        return self.engine.tensor_parallel_size * self.engine.pipeline_parallel_size


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
    spin-waiting (``sched_yield``) for each other at every step. On 2 cores those two spinners
    took ~1.7 cores and starved vLLM's own API server: 18-24 requests/s at 8 clients with the
    tokens of a request arriving in one burst, against 104 requests/s and TTFT p50 14 ms with
    ``uni`` and one OpenMP thread (docs/performance.md, "Session 3: one process per CPU engine").
    """
    backend = _extra(spec, "distributed-executor-backend")
    return not spec.use_gpu and spec.world_size == 1 and backend in (None, "uni")


def vllm_command(spec: EngineSpec, host: str, port: int, token: str) -> list[str]:
    """Arguments after ``python`` that start vLLM's OpenAI server for this spec."""
    e = spec.engine
    args = [
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        spec.path,
        "--served-model-name",
        spec.model,
        "--host",
        host,
        "--port",
        str(port),
        f"--api-key={token}",  # one argument: a token_urlsafe token may start with "-"
        "--max-model-len",
        str(e.max_model_len),
        "--dtype",
        e.dtype,
        "--max-num-seqs",
        str(e.max_num_seqs),
        "--tensor-parallel-size",
        str(e.tensor_parallel_size),
        "--pipeline-parallel-size",
        str(e.pipeline_parallel_size),
        "--seed",
        str(e.seed),
        "--enable-prefix-caching" if e.enable_prefix_caching else "--no-enable-prefix-caching",
        "--disable-uvicorn-access-log",
        "--uvicorn-log-level",
        "warning",
        "--disable-fastapi-docs",
    ]
    if spec.use_gpu:
        args += ["--gpu-memory-utilization", str(e.gpu_memory_utilization)]
    if single_process(spec) and _extra(spec, "distributed-executor-backend") is None:
        args += ["--distributed-executor-backend", "uni"]
    for key, value in e.extra_args.items():
        if value is True:
            args.append(_flag(key))
        elif value is False:
            args.append("--no-" + key.replace("_", "-"))
        else:
            args += [_flag(key), str(value)]
    return args


def cpu_bind_groups(world_size: int, cpus: list[int]) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``world_size`` CPU ranks: the cores split into groups,
    ranks separated by ``|`` (e.g. ``0|1`` for two ranks on two cores)."""
    if world_size <= 1:
        return ",".join(map(str, cpus))
    if len(cpus) < world_size:
        raise ValueError(f"{world_size} CPU ranks need at least {world_size} cores, have {len(cpus)}")
    size = len(cpus) // world_size
    groups = [cpus[i * size : (i + 1) * size] for i in range(world_size)]
    return "|".join(",".join(str(c) for c in g) if len(g) > 1 else str(g[0]) for g in groups)


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (on this node)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def claim_cores(count: int, owner: int, cpus: list[int] | None = None, ledger: Path | None = None) -> list[int]:
    """``count`` cores for one CPU engine on this node: the least-claimed ones, recorded under
    ``owner`` (the replica's pid) in a node-local ledger; claims of dead processes are dropped.

    vLLM's own ``auto`` binding puts every engine of a node on the same cores (all but one, from
    core 0): two replicas or two models on one machine would share one core while the others idle.
    """
    import fcntl

    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    ledger = ledger or CORE_LEDGER
    with open(ledger, "a+", encoding="utf-8") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        try:
            raw = json.loads(f.read() or "{}")
        except json.JSONDecodeError:
            raw = {}
        claims = {int(pid): list(cores) for pid, cores in raw.items() if int(pid) != owner and pid_alive(int(pid))}
        use = Counter(c for cores in claims.values() for c in cores)
        chosen = sorted(sorted(cpus, key=lambda c: (use[c], c))[: max(1, min(count, len(cpus)))])
        claims[owner] = chosen
        f.seek(0)
        f.truncate()
        f.write(json.dumps({str(k): v for k, v in claims.items()}))
    return chosen


def claimed_cores(ledger: Path | None = None) -> set[int]:
    """Every core that a live engine on this node has claimed (see :func:`claim_cores`)."""
    try:
        raw = json.loads((ledger or CORE_LEDGER).read_text() or "{}")
    except (OSError, json.JSONDecodeError):
        return set()
    return {c for pid, cores in raw.items() if pid_alive(int(pid)) for c in cores}


def engine_core_pid(api_pid: int, proc: Path = Path("/proc")) -> int | None:
    """The ``VLLM::EngineCore`` process that vLLM's API server ``api_pid`` started, if any."""
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        if ppid == api_pid and comm.startswith("VLLM::EngineCor"):
            return int(d.name)
    return None


def _set_affinity(pid: int, cores: set[int]) -> None:
    """``cores`` for every thread of ``pid`` (threads started later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except (ProcessLookupError, FileNotFoundError):  # a thread that just ended
            continue


def spare_cores(cores: list[int], cpus: list[int] | None = None, ledger: Path | None = None) -> list[int]:
    """This node's cores that neither ``cores`` nor any live engine's claim includes."""
    taken = claimed_cores(ledger) | set(cores)
    return [c for c in sorted(cpus if cpus is not None else os.sched_getaffinity(0)) if c not in taken]


def pin_single_process(
    api_pid: int, engine_pid: int, cores: list[int], spare: list[int], cpus: list[int] | None = None
) -> None:
    """Give a single-process CPU engine its claimed ``cores`` to itself: its ``EngineCore``
    process (``engine_pid``, which runs the model) on ``cores``, its API server (``api_pid``) on
    ``spare`` (:func:`spare_cores`). With no spare core nothing is pinned: both may use every core.

    Why (docs/performance.md, "Session 5"): unpinned, the stack's other processes (the gateway,
    the API server, Ray's) run on the engine's core as often as not and the engine loses steps;
    on the 2-core box, pinning one engine and its API server this way took the stack from 72-82
    to 86-97 requests/s at 8 clients, while bare vLLM, with no gateway, hardly changed.
    """
    every = set(cpus if cpus is not None else os.sched_getaffinity(0))
    _set_affinity(engine_pid, set(cores) if spare else every)
    _set_affinity(api_pid, set(spare) if spare else every)


def engine_environ(environ: dict[str, str], spec: EngineSpec, cores: list[int] | None = None) -> dict[str, str]:
    """The engine process's whole environment: the replica's, less ``spec.secret_env`` (API keys
    of the gateway's tenants, which a pod gets from its Secret), plus :func:`vllm_env`."""
    hidden = set(spec.secret_env)
    return {**{k: v for k, v in environ.items() if k not in hidden}, **vllm_env(spec, cores)}


def vllm_env(spec: EngineSpec, cores: list[int] | None = None) -> dict[str, str]:
    """Environment for the engine process: offline, no prompt logging, CPU cache; for a
    single-process CPU engine, in-process execution with ``cpus_per_rank`` OpenMP threads, else
    the ranks' core binding (to ``cores`` when given, split over the ranks)."""
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
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
