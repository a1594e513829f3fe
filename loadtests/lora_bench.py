"""Benchmark: what LoRA costs a base's own traffic, and N adapters on one engine vs one engine each.

    python -m loadtests.lora_bench --base-dir checkpoints/adder/v1 \
        --adapter max-lora@v1=checkpoints/max-lora/v1 --adapter sub-lora@v1=checkpoints/sub-lora/v1 \
        [--rounds 2] [--requests 200] [--concurrency 8] [--out reports/lora]

Three configurations, each started as bare vLLM on loopback with the command line and placement
our model replicas use (:class:`loadtests.servers.Server`, kind ``bare``), measured with the
benchmark's closed-loop streaming client (:func:`loadtests.client.run_targets`):

- ``off``: the base without LoRA; base-only traffic.
- ``shared``: the same base with LoRA on (``--enable-lora``, :class:`serving.config.LoraSlots`)
  and every adapter registered through vLLM's ``/v1/load_lora_adapter``, as
  :mod:`serving.replica.adapters` does; base-only traffic, then an even mix of the adapters.
- ``split``: one LoRA engine per adapter, each with only its adapter registered; the same mix,
  each request sent to its adapter's engine.

After its levels, each configuration's memory: the summed RSS and PSS (``/proc/<pid>/smaps_rollup``)
of every process in its engines' sessions. Every round runs the configurations in turn, the order
reversed every other round; the tables show each round's ratios (shared vs off for the base's
traffic, shared vs split for the mix) and their medians. Writes ``lora_bench.json`` and
``lora_bench.md`` under ``--out``; the engine logs under ``--out``/logs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

from loadtests.bench import WARMUP_REQUESTS
from loadtests.bench_tables import round_orders
from loadtests.client import Target, run_targets
from loadtests.cpuprof import load_avg
from loadtests.servers import BenchModel, Server, running, session_pids
from loadtests.workload import completion_bodies, prompt_pool
from serving.config import EngineConfig, LoraSlots

__all__ = ["figures_table", "main", "parse_rollup", "pool_size", "ratio_rows", "traffic"]

CONFIGS = ("off", "shared", "split")
FIRST_PORT = 8041
COMPILE_RE = re.compile(r"compil", re.IGNORECASE)


def parse_rollup(text: str) -> dict[str, int]:
    """``Rss`` and ``Pss`` of one ``/proc/<pid>/smaps_rollup``, in KiB (0 when absent)."""
    out = {"Rss": 0, "Pss": 0}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in out and rest.split():
            out[key] = int(rest.split()[0])
    return out


def engines_memory(servers: list[Server]) -> dict[str, float]:
    """Summed RSS and PSS (MiB) of every process in the servers' sessions (API server, EngineCore)."""
    rss = pss = procs = 0
    for s in servers:
        assert s.proc is not None
        for pid in session_pids(s.proc.pid):
            try:
                m = parse_rollup(Path(f"/proc/{pid}/smaps_rollup").read_text())
            except OSError:
                continue
            rss, pss, procs = rss + m["Rss"], pss + m["Pss"], procs + 1
    return {"rss_mib": round(rss / 1024, 1), "pss_mib": round(pss / 1024, 1), "processes": procs}


def register(server: Server, name: str, path: str) -> None:
    """Register one adapter with a running engine, as :class:`serving.replica.adapters.AdapterSet` does."""
    headers = {"authorization": f"Bearer {server.api_key}"}
    body = {"lora_name": name, "lora_path": path}
    r = httpx.post(f"{server.base_url}/v1/load_lora_adapter", json=body, headers=headers, timeout=120)
    if r.status_code != 200:
        raise RuntimeError(f"vLLM refused adapter {name}: {r.status_code} {r.text[:300]}")


def compile_lines(log: Path, limit: int = 3) -> list[str]:
    """The engine log's lines about compilation, the compilation mode of its config line first."""
    lines, mode = [], []
    for line in log.read_text(errors="replace").splitlines():
        found = re.search(r"'mode': <?([A-Za-z_.]+)", line) if "compilation_config" in line else None
        if found:
            mode.append(f"compilation_config mode: {found.group(1)}")
        elif COMPILE_RE.search(line):
            lines.append(line.strip()[:240])
    return mode[:1] + lines[:limit]


@contextmanager
def engines(config: str, a: argparse.Namespace, log_dir: Path) -> Iterator[list[Server]]:
    """The configuration's engines, serving, with their adapters registered; stopped on exit."""
    lora = LoraSlots(max_loras=a.max_loras, max_cpu_loras=a.max_cpu_loras, max_lora_rank=a.max_lora_rank)
    plans: list[dict[str, str]] = [{}] if config == "off" else [dict(a.adapters)]
    if config == "split":
        plans = [{name: path} for name, path in a.adapters]
    with ExitStack() as stack:
        servers = []
        for k, adapters in enumerate(plans):
            model = BenchModel(a.base_dir, a.engine, name=a.base_name, lora=None if config == "off" else lora)
            server = Server("bare", model, log_dir / f"{config}-{k}", FIRST_PORT + k)
            stack.enter_context(running(server, a.start_timeout))
            for name, path in adapters.items():
                register(server, name, path)
            servers.append(server)
        yield servers


def pool_size(a: argparse.Namespace) -> int:
    """How many prompts a run needs: a chunk per target (the base and each adapter), each as long
    as a level's warm-ups and measured requests."""
    per_target: int = WARMUP_REQUESTS + a.concurrency + a.requests
    return (1 + len(a.adapters)) * per_target


def traffic(config: str, servers: list[Server], a: argparse.Namespace, prompts: list[str]) -> dict[str, list[Target]]:
    """The levels a configuration is measured at: the base's own traffic and/or the adapter mix."""
    # every target (the base, each adapter) walks its own prompts: no prefix-cache hits across them
    chunk = len(prompts) // (1 + len(a.adapters))
    if chunk < 1:
        raise ValueError(f"{len(prompts)} prompts for {1 + len(a.adapters)} targets: at least one each")

    def target(server: Server, model: str, n: int) -> Target:
        make = completion_bodies(model, prompts[n * chunk : (n + 1) * chunk], a.output_tokens)
        return Target(server.base_url, server.api_key, "/v1/completions", make)

    names = [name for name, _ in a.adapters]
    levels: dict[str, list[Target]] = {}
    if config in ("off", "shared"):
        levels["base"] = [target(servers[0], a.base_name, 0)]
    if config == "shared":
        levels["mix"] = [target(servers[0], name, 1 + n) for n, name in enumerate(names)]
    if config == "split":
        levels["mix"] = [target(s, name, 1 + n) for n, (s, name) in enumerate(zip(servers, names, strict=True))]
    return levels


def measure_config(config: str, a: argparse.Namespace, prompts: list[str], log_dir: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    with engines(config, a, log_dir) as servers:
        print(f"  {config}: {len(servers)} engine(s) serving after {time.monotonic() - t0:.0f}s", flush=True)
        levels = traffic(config, servers, a, prompts)
        for targets in levels.values():
            asyncio.run(run_targets(targets, 4, WARMUP_REQUESTS))
        time.sleep(a.settle_s)
        out: dict[str, Any] = {}
        for kind, targets in levels.items():
            load = load_avg()
            r = asyncio.run(run_targets(targets, a.concurrency, a.requests, warmup=a.concurrency))
            out[kind] = {**r.as_dict(), "load_before": round(load, 2)}
            print(
                f"  {config:6} {kind:4} c={a.concurrency} {r.requests_per_s:7.2f} req/s  TTFT p50 "
                f"{r.ttft_p50_ms or 0:5.0f} ms  ITL p50 {r.itl_p50_ms or 0:5.2f} ms  failures {r.failures}  "
                f"load {load:.1f}",
                flush=True,
            )
        out["memory"] = engines_memory(servers)
        print(f"  {config:6} memory {out['memory']}", flush=True)
    out["compilation"] = compile_lines(log_dir / f"{config}-0" / "bare.log")
    return out


def _ratio(a: dict[str, Any], b: dict[str, Any], key: str) -> float | None:
    """``a[key] / b[key]``; None where either lacks the figure (no TTFT when every request failed) or b's is 0."""
    v, w = a.get(key), b.get(key)
    return None if v is None or not w else v / w


def ratio_rows(rounds: list[dict[str, Any]]) -> list[dict[str, float | None]]:
    """Each round's comparisons: LoRA on vs off for the base's traffic, shared vs split for the mix."""
    rows = []
    for rnd in rounds:
        off, shared, split = (rnd["results"][c] for c in CONFIGS)
        rows.append(
            {
                "base_rps_on_off": _ratio(shared["base"], off["base"], "requests_per_s"),
                "base_ttft_p50_on_off": _ratio(shared["base"], off["base"], "ttft_p50_ms"),
                "base_itl_p50_on_off": _ratio(shared["base"], off["base"], "itl_p50_ms"),
                "mix_rps_shared_split": _ratio(shared["mix"], split["mix"], "requests_per_s"),
                "pss_shared_split": _ratio(shared["memory"], split["memory"], "pss_mib"),
                "pss_on_off": _ratio(shared["memory"], off["memory"], "pss_mib"),
            }
        )
    return rows


def figures_table(rounds: list[dict[str, Any]], adapters: int) -> str:
    """Markdown: every configuration's figures per round (``split`` runs an engine per adapter)."""
    lines = [
        "| round | config | engines | traffic | req/s | TTFT p50 ms | ITL p50 ms | failures | PSS MiB | RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, rnd in enumerate(rounds, 1):
        for config in CONFIGS:
            res = rnd["results"][config]
            mem = res["memory"]
            engines_n = adapters if config == "split" else 1
            for kind in ("base", "mix"):
                if kind in res:
                    r = res[kind]
                    lines.append(
                        f"| {i} | {config} | {engines_n} | {kind} | {r['requests_per_s']:.2f} | "
                        f"{_fmt(r.get('ttft_p50_ms'), '{:.0f}')} | {_fmt(r.get('itl_p50_ms'), '{:.2f}')} | "
                        f"{r['failures']} | "
                        f"{mem['pss_mib']:.0f} | {mem['rss_mib']:.0f} |"
                    )
    return "\n".join(lines)


def _fmt(v: float | None, fmt: str) -> str:
    return "-" if v is None else fmt.format(v)


def ratios_table(rounds: list[dict[str, Any]]) -> str:
    """Markdown: each round's ratios and their medians ("-" where a round lacks the figure; the
    median over the rounds that have it, with a footnote when fewer than all)."""
    rows = ratio_rows(rounds)
    keys = list(rows[0])
    lines = ["| round (order) | " + " | ".join(keys) + " |", "|" + "---|" * (len(keys) + 1)]
    for rnd, row in zip(rounds, rows, strict=True):
        lines.append(
            f"| {rnd['round']} ({','.join(rnd['order'])}) | " + " | ".join(_fmt(row[k], "{:.2f}") for k in keys)
        )
    cells: list[str] = []
    notes: list[str] = []
    for k in keys:
        have = [v for v in (r[k] for r in rows) if v is not None]
        cells.append(f"**{statistics.median(have):.2f}**" if have else "-")
        if have and len(have) < len(rows):
            notes.append(f"[{len(notes) + 1}] {k}: median over {len(have)} of {len(rows)} rounds (the others lack it)")
            cells[-1] += f" [{len(notes)}]"
    lines.append(f"| median | {' | '.join(cells)} |")
    lines = [line if line.endswith("|") else line + " |" for line in lines]
    return "\n".join(lines + ([""] + notes if notes else []))


def _adapter(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not Path(path).is_dir():
        raise argparse.ArgumentTypeError(f"--adapter wants NAME=DIR with an adapter folder, got {text!r}")
    return name, str(Path(path).resolve())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m loadtests.lora_bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--base-dir", required=True, help="the base model's folder")
    ap.add_argument("--base-name", default="adder@v1", help="served name of the base")
    ap.add_argument("--adapter", dest="adapters", type=_adapter, action="append", required=True, help="NAME=DIR")
    ap.add_argument("--out", type=Path, default=Path("reports/lora"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=200, help="measured requests per level")
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-loras", type=int, default=2)
    ap.add_argument("--max-cpu-loras", type=int, default=4)
    ap.add_argument("--max-lora-rank", type=int, default=16)
    ap.add_argument("--settle-s", type=float, default=5, help="idle seconds after warm-up, before the levels")
    ap.add_argument("--start-timeout", type=float, default=600)
    a = ap.parse_args(argv)
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    a.base_dir = str(Path(a.base_dir).resolve())
    a.engine = EngineConfig(max_model_len=a.max_model_len, dtype="float32", kv_cache_space_gib=1)
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    prompts = prompt_pool(a.base_dir, a.prompt_tokens, n=pool_size(a))
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    rounds: list[dict[str, Any]] = []
    for i, order in enumerate(round_orders(list(CONFIGS), a.rounds), 1):
        print(f"round {i} of {a.rounds}: {', '.join(order)} (load {load_avg():.1f})", flush=True)
        results = {c: measure_config(c, a, prompts, a.out / "logs" / f"r{i}") for c in order}
        rounds.append({"round": i, "order": order, "results": results})
    meta = {"argv": argv, "started": started, "ended": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count()}
    doc = {"meta": meta | {"adapters": a.adapters, "engine": a.engine.model_dump(mode="json")}, "rounds": rounds}
    (a.out / "lora_bench.json").write_text(json.dumps(doc, indent=2) + "\n")
    compilation = {c: rounds[0]["results"][c]["compilation"] for c in ("off", "shared")}
    table = f"{figures_table(rounds, len(a.adapters))}\n\nEach round's ratios:\n\n{ratios_table(rounds)}\n\n"
    table += "Compilation (round 1 logs):\n"
    table += "".join(f"\n- {c}: " + " / ".join(lines or ["(no line)"]) for c, lines in compilation.items())
    (a.out / "lora_bench.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
