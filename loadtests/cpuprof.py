"""Where the CPU goes during a benchmark level: every process on the machine, grouped by role.

On a 2-core machine every CPU-second a proxy, gateway or Ray daemon spends is taken from the engine,
so the benchmark records, per level, the CPU time (user + system, from ``/proc/<pid>/stat``) of each
group below over the level's wall time. A process started during a level counts from its start; one
that ended during it is missed. Linux only (elsewhere the split is empty).

    python -m loadtests.cpuprof [--seconds 30]    # the same split, now, e.g. of an idle stack
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

from serving.replica.placement import engine_core_pid, proc_stat

__all__ = [
    "AFFINITY_GROUPS",
    "GROUPS",
    "VLLM_GROUPS",
    "affinity_by_group",
    "affinity_of",
    "cpu_by_group",
    "cpu_seconds",
    "engine_processes",
    "group_of",
    "load_avg",
    "main",
    "median_cores",
    "split",
]

# (group, test on "comm\0cmdline"), first match wins
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("engine worker", ("VLLM::Worker",)),
    ("engine core", ("VLLM::EngineCor",)),
    ("vLLM API server", ("vllm.entrypoints.launchers.api_server.entry", "vllm.entrypoints.openai.api_server")),
    ("gateway replica", ("ServeReplica:gateway:", "OpenAiIngress", "LLMRouter")),  # ours; stock ingress
    ("model replica", ("ServeReplica:",)),
    ("Serve proxy", ("ProxyActor", "haproxy")),
    ("Serve controller", ("ServeController",)),
    (
        "Ray daemons",
        (
            "raylet",
            "gcs_server",
            "dashboard",
            "ray::",
            "log_monitor",
            "monitor.py",
            "ray.util.client.server",
            "ray start",
            "runtime_env",
        ),
    ),
    ("benchmark client", ("loadtests.bench",)),
    ("vllm-router", ("vllm::router",)),  # the title it gives itself (comm and argv)
)

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def load_avg() -> float:
    """The 1-minute load average, recorded before and after each benchmark level."""
    return os.getloadavg()[0]


def group_of(comm: str, cmdline: str) -> str:
    text = f"{comm}\0{cmdline}"
    for name, needles in GROUPS:
        if any(n in text for n in needles):
            return name
    return "other"


def _read(pid_dir: Path) -> tuple[str, float] | None:
    r = _read_full(pid_dir)
    return (r[0], r[1]) if r else None


def _read_full(pid_dir: Path) -> tuple[str, float, str] | None:
    """(group, CPU seconds, comm) of one process; None if it is gone."""
    stat = proc_stat(pid_dir)
    if stat is None:
        return None
    try:
        cmdline = (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return None
    comm, fields = stat
    cpu = (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime
    return group_of(comm, cmdline), cpu, comm


def _untitled_engine_cores(groups: dict[int, str], proc: Path) -> set[int]:
    """EngineCore processes that carry no ``VLLM::`` title (vLLM titles them with
    ``setproctitle`` where it is installed), found as their API server's child."""
    found = set()
    for pid, group in groups.items():
        if group == "vLLM API server":
            core = engine_core_pid(pid, proc)
            if core is not None and groups.get(core) != "engine core":
                found.add(core)
    return found


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) one process has used so far; 0 if it is gone."""
    r = _read(Path("/proc") / str(pid))
    return r[1] if r else 0.0


def cpu_by_group(proc: Path = Path("/proc")) -> dict[int, tuple[str, float]]:
    """pid -> (group, CPU seconds used so far)."""
    return {pid: (group, cpu) for pid, (group, cpu, _) in _table(proc).items()}


def _table(proc: Path) -> dict[int, tuple[str, float, str]]:
    out: dict[int, tuple[str, float, str]] = {}
    if not proc.is_dir():
        return out
    for d in proc.iterdir():
        if d.name.isdigit():
            r = _read_full(d)
            if r is not None:
                out[int(d.name)] = r
    for pid in _untitled_engine_cores({pid: r[0] for pid, r in out.items()}, proc):
        if pid in out:
            out[pid] = ("engine core", out[pid][1], out[pid][2])
    return out


VLLM_GROUPS = ("engine core", "engine worker", "vLLM API server")
AFFINITY_GROUPS = ("engine core", "vLLM API server")  # where the benchmark checks the pinning


def engine_processes(groups: tuple[str, ...] = VLLM_GROUPS, proc: Path = Path("/proc")) -> list[dict[str, Any]]:
    """Every process of ``groups`` now (by default vLLM's: engine core, worker, API server): pid,
    comm, group and the cores it may run on."""
    out: list[dict[str, Any]] = []
    for pid, (group, _, comm) in sorted(_table(proc).items()):
        if group in groups:
            try:
                cores = sorted(os.sched_getaffinity(pid))
            except OSError:  # gone meanwhile
                continue
            out.append({"pid": pid, "comm": comm, "group": group, "cores": cores})
    return out


def affinity_of(processes: list[dict[str, Any]], groups: tuple[str, ...] = AFFINITY_GROUPS) -> dict[str, list[int]]:
    """The cores the listed processes of each of ``groups`` may run on (the union over the group)."""
    out: dict[str, set[int]] = {}
    for p in processes:
        if p["group"] in groups:
            out.setdefault(p["group"], set()).update(p["cores"])
    return {g: sorted(cores) for g, cores in sorted(out.items())}


def affinity_by_group(groups: tuple[str, ...] = AFFINITY_GROUPS, proc: Path = Path("/proc")) -> dict[str, list[int]]:
    """The cores the processes of each of ``groups`` may run on now (the union over the group)."""
    return affinity_of(engine_processes(groups, proc), groups)


def split(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], wall_s: float) -> dict[str, float]:
    """Cores used per group between two samples (CPU seconds / wall seconds), largest first."""
    used: dict[str, float] = {}
    for pid, (group, cpu) in after.items():
        start = before.get(pid, (group, 0.0))[1]
        used[group] = used.get(group, 0.0) + max(0.0, cpu - start)
    return {g: round(s / wall_s, 3) for g, s in sorted(used.items(), key=lambda kv: -kv[1]) if s > 0}


def median_cores(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Several rounds' ``cores_by_group`` of one level as one: the median per group (a group a
    round did not see counts as 0 there)."""
    groups = sorted({g for r in rows for g in r.get("cores_by_group", {})})
    return {g: round(statistics.median(r.get("cores_by_group", {}).get(g, 0.0) for r in rows), 3) for g in groups}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m loadtests.cpuprof", description="Cores used per group of processes over a window."
    )
    p.add_argument("--seconds", type=float, default=30.0)
    a = p.parse_args(argv)
    before, t0 = cpu_by_group(), time.monotonic()
    time.sleep(a.seconds)
    used = split(before, cpu_by_group(), time.monotonic() - t0)
    for group, cores in used.items():
        print(f"{group:18} {cores:.3f}")
    print(f"{'total':18} {sum(used.values()):.3f}  (over {a.seconds:g} s)")


if __name__ == "__main__":
    main()
