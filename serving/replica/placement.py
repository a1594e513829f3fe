"""CPU placement of engines on one node: which cores each engine claims, and pinning.

A node-local ledger (a JSON file on tmpfs, locked with ``flock``) records the cores each CPU
engine on the node claimed, keyed by the claiming replica's pid; claims of dead processes are
dropped on the next claim. A multi-rank engine's ranks are bound to their cores by vLLM
(``VLLM_CPU_OMP_THREADS_BIND``); a single-process engine is pinned here once it runs: its
``EngineCore`` process on its claimed cores, its API server on the cores no engine claims, so the
node's other processes (gateway, Ray, API servers) do not take turns on the engine's core.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

__all__ = [
    "CORE_LEDGER",
    "EnginePinning",
    "claim_cores",
    "claimed_cores",
    "cpu_bind_groups",
    "engine_core_pid",
    "pid_alive",
    "pin_single_process",
    "proc_stat",
    "spare_cores",
]

# Node-local record of which cores each CPU engine is bound to (tmpfs: gone at reboot, per pod on K8s)
CORE_LEDGER = Path(os.environ.get("RAYSTACK_CORE_LEDGER", "/dev/shm/raystack-engine-cores.json"))


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


def proc_stat(pid_dir: Path) -> tuple[str, list[str]] | None:
    """One process's ``/proc/<pid>/stat``: its command name (comm) and the fields after it
    (state, ppid, pgrp, ...); None if it is gone."""
    try:
        stat = (pid_dir / "stat").read_text()
    except OSError:
        return None
    return stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()


def engine_core_pid(api_pid: int, proc: Path = Path("/proc")) -> int | None:
    """The ``EngineCore`` process that vLLM's API server ``api_pid`` started, if any: the child
    titled ``VLLM::EngineCore``, else (no ``setproctitle`` in that environment) its one child
    that is a multiprocessing child (forked: the parent's command line; spawned: ``spawn_main``)."""
    try:
        parent = (proc / str(api_pid) / "cmdline").read_bytes()
    except OSError:
        return None
    untitled: list[int] = []
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        stat = proc_stat(d)
        if stat is None or int(stat[1][1]) != api_pid:
            continue
        comm = stat[0]
        try:
            cmdline = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if comm.startswith("VLLM::EngineCor"):
            return int(d.name)
        if cmdline == parent or b"multiprocessing.spawn" in cmdline:
            untitled.append(int(d.name))
    return untitled[0] if len(untitled) == 1 else None


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

    Unpinned, the node's other processes (the gateway, the API server, Ray's) run on the engine's
    core as often as not and the engine loses steps (docs/performance.md, "Engine placement").
    """
    every = set(cpus if cpus is not None else os.sched_getaffinity(0))
    _set_affinity(engine_pid, set(cores) if spare else every)
    _set_affinity(api_pid, set(spare) if spare else every)


class EnginePinning:
    """Keeps one single-process CPU engine on its claimed ``cores`` and its API server on the
    node's spare ones (:func:`pin_single_process`); :meth:`apply` re-applies the split when the
    spare set changed (engines come and go on the node) and returns the API server's cores then,
    None when nothing changed."""

    def __init__(
        self, api_pid: int, engine_pid: int, cores: list[int], cpus: list[int] | None = None, ledger: Path | None = None
    ) -> None:
        self.api_pid, self.engine_pid, self.cores = api_pid, engine_pid, cores
        self.cpus, self.ledger = cpus, ledger
        self.api_cores: list[int] | None = None

    def apply(self) -> list[int] | None:
        rest = spare_cores(self.cores, self.cpus, self.ledger)
        if rest == self.api_cores:
            return None
        pin_single_process(self.api_pid, self.engine_pid, self.cores, rest, self.cpus)
        self.api_cores = rest
        return rest
