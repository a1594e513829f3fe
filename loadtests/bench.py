"""Benchmark: bare vLLM vs stock Ray Serve LLM vs this stack, on one model, in one run.

    python -m loadtests.bench --model-dir DIR --out reports/bench [--concurrency 1 8 32] \
        [--requests 200] [--output-tokens 64] [--prompt-tokens 16] [--servers bare,rayllm,ours] \
        [--rounds 1]
    python -m loadtests.bench --model-dir DIR --out reports/prefix --prefix-routing
    python -m loadtests.bench --model-dir DIR --out reports/kv --kv-routing \
        [--routers power_of_two,prefix_affinity,kv_aware,vllm-router] [--workloads pressure,distinct]

Each server is started, warmed up, measured at every concurrency with closed-loop streaming
clients (fixed prompt and output lengths, ``ignore_eos``), and stopped before the next one starts.
Prints a table (requests/s, output tokens/s, TTFT p50/p99, ITL p50, each also as a ratio to bare
vLLM) and writes ``bench.json`` and ``bench.png``. ``--rounds N`` measures every server N times,
the order reversed every other round (on a small VM the same server's figures move by a quarter
from run to run, and the one measured second tends to do worse): the main table then shows each
figure's median over the rounds, and a second table each round's ratios to bare vLLM and their
median. ``--prefix-routing`` instead runs this stack
twice with two replicas, under ``router: prefix_affinity`` and ``router: power_of_two``, on long
shared system prompts, and compares the two. ``--kv-routing`` compares routers (ours and
vllm-router) where prefixes overflow one engine's KV cache (:mod:`loadtests.kv_bench`). See
docs/performance.md for measured figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import time
from pathlib import Path
from typing import Any

from loadtests.bench_tables import cpu_table, median_rows, plot, ratio_table, round_orders, rounds_table
from loadtests.client import LevelResult, run_level
from loadtests.cpuprof import (
    affinity_by_group,
    affinity_of,
    cpu_by_group,
    engine_processes,
    load_avg,
    split,
)
from loadtests.scenario import RequestSpec, SharedPrefix
from loadtests.servers import KINDS, BenchModel, Server, make_server, running
from loadtests.workload import RequestFactory, completion_bodies, prompt_pool
from serving.config import EngineConfig

__all__ = ["WARMUP_REQUESTS", "main", "measure"]

WARMUP_REQUESTS = 8  # per server, before the first level (plus one per client before each level)


def measure(
    server: Server, make_body: Any, path: str, levels: list[int], requests: int, log: Any = print, settle_s: float = 0.0
) -> list[dict[str, Any]]:
    out = []
    asyncio.run(run_level(server.base_url, server.api_key, path, make_body, 4, WARMUP_REQUESTS))
    # a Ray head keeps busy for a while after it answers (dashboard modules, agents); on 2 cores
    # that decides the first level, so every server gets the same quiet period first
    time.sleep(settle_s)
    for c in levels:
        load = load_avg()
        processes = engine_processes()
        placed = affinity_of(processes)
        before, t0 = cpu_by_group(), time.monotonic()
        r: LevelResult = asyncio.run(run_level(server.base_url, server.api_key, path, make_body, c, requests, warmup=c))
        cores = split(before, cpu_by_group(), time.monotonic() - t0)  # the level incl. its warm-up
        # sampled before and after the level: a process seen in either counts, with every core it
        # was allowed at either moment
        for group, allowed in affinity_by_group().items():
            placed[group] = sorted(set(placed.get(group, [])) | set(allowed))
        row = {
            **r.as_dict(),
            "load_before": round(load, 2),
            "load_after": round(load_avg(), 2),
            "cores_by_group": cores,
            "affinity": dict(sorted(placed.items())),
            "vllm_processes": processes,  # at the level's start: pid, comm, group, cores
        }
        out.append(row)
        log(
            f"  {server.kind:10} c={c:<3} {r.requests_per_s:7.2f} req/s {r.output_tokens_per_s:8.0f} tok/s  "
            f"TTFT p50 {r.ttft_p50_ms or 0:6.0f} ms p99 {r.ttft_p99_ms or 0:6.0f} ms  failures {r.failures}  "
            f"client CPU {r.client_cpu_s / r.wall_s:.0%}  load {load:.1f}"
        )
        log("    cores: " + ", ".join(f"{g} {v:.2f}" for g, v in cores.items()))
        if row["affinity"]:
            log("    may run on cores: " + ", ".join(f"{g} {v}" for g, v in row["affinity"].items()))
    return out


def run_servers(a: argparse.Namespace, model: BenchModel, log: Any = print) -> list[dict[str, Any]]:
    """Every server in turn, ``a.rounds`` times; one ``{"order", "results"}`` per round."""
    per_server = WARMUP_REQUESTS + sum(c + a.requests for c in a.concurrency)
    prompts = prompt_pool(model.path, a.prompt_tokens, n=min(per_server, 20_000))
    rounds = []
    for i, order in enumerate(round_orders(a.servers, a.rounds), 1):
        results: dict[str, list[dict[str, Any]]] = {}
        for kind in order:
            tag = f" (round {i} of {a.rounds})" if a.rounds > 1 else ""
            log(f"starting {kind}{tag} (load {load_avg():.1f})...")
            t0 = time.monotonic()
            base, gateway = server_variant(kind)
            with running(make_server(base, model, a.out / "logs", **gateway), a.start_timeout) as server:
                pid = f", process group {server.proc.pid}" if server.proc else ""
                log(f"  {kind} serving after {time.monotonic() - t0:.0f}s{pid}")
                make = completion_bodies(model.name, prompts, a.output_tokens)
                results[kind] = measure(server, make, "/v1/completions", a.concurrency, a.requests, log, a.settle_s)
        rounds.append({"order": order, "results": {k: results[k] for k in a.servers}})
    return rounds


def server_variant(name: str) -> tuple[str, dict[str, Any]]:
    """``ours@max_migrations=0`` -> ("ours", {"gateway": {"max_migrations": 0}}): a server kind,
    and for one of ours further ``gateway:`` fields (``+`` between several), so that a gateway
    setting is measured against the default in the same rounds."""
    base, _, fields = name.partition("@")
    if not fields:
        return base, {}
    if not base.startswith("ours"):
        raise SystemExit(f"--servers {name}: gateway fields apply to ours only")
    return base, {"gateway": dict(_engine_arg(f) for f in fields.split("+"))}


def run_prefix_routing(a: argparse.Namespace, model: BenchModel, log: Any = print) -> dict[str, list[dict[str, Any]]]:
    prefix = SharedPrefix(count=a.prefixes, chars=a.prefix_chars)
    spec = RequestSpec(
        name="prefix",
        model=model.name,
        endpoint="chat",
        prompt="{text}",
        user_chars=24,
        max_tokens=a.output_tokens,
        shared_prefix=prefix,
    )
    results: dict[str, list[dict[str, Any]]] = {}
    for router in ("prefix_affinity", "power_of_two"):
        factory = RequestFactory(spec, random.Random(0))  # the same request sequence for both
        log(f"starting ours with 2 replicas, router {router} (load {load_avg():.1f})...")
        server = make_server("ours-ha" if a.ha else "ours", model, a.out / "logs", replicas=2, router=router)
        with running(server, a.start_timeout):
            results[router] = measure(server, factory.body, factory.path, a.concurrency, a.requests, log, a.settle_s)
    return results


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m loadtests.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model-dir", required=True, help="HF model directory (python -m loadtests.models)")
    ap.add_argument("--out", type=Path, default=Path("reports/bench"))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests", type=int, default=200, help="measured requests per concurrency")
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument(
        "--servers",
        default="bare,rayllm,ours",
        help="bare,bare-mp,rayllm,rayllm-ha,ours,ours-lease,ours-proxy,ours-ha; "
        "ours@FIELD=VALUE[+...] also sets gateway fields",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every server this many times, the order reversed every other round; the table shows medians",
    )
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on GPU")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument(
        "--no-pin-cores",
        action="store_true",
        help="leave a CPU engine and its API server unpinned (engine.pin_cores: false), for ours and bare",
    )
    ap.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="further vLLM flag for every server, e.g. num-gpu-blocks-override=64 (repeatable)",
    )
    ap.add_argument("--gpu", action="store_true", help="CUDA vLLM, one GPU per server")
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--settle-s", type=float, default=30, help="idle seconds after warm-up, before the first level")
    ap.add_argument("--prefix-routing", action="store_true", help="prefix_affinity vs power_of_two, 2 replicas")
    ap.add_argument("--prefixes", type=int, default=8, help="prefix mode: shared system prompts")
    ap.add_argument("--prefix-chars", type=int, default=400, help="prefix mode: length of each")
    ap.add_argument("--ha", action="store_true", help="prefix mode: our stack in HAProxy ingress mode")
    from loadtests import kv_bench

    kv_bench.add_arguments(ap)
    a = ap.parse_args(argv)
    kv_bench.check_arguments(ap, a)
    a.servers = [s.strip() for s in a.servers.split(",") if s.strip()]
    for name in a.servers:
        if server_variant(name)[0] not in KINDS:
            ap.error(f"--servers: unknown server {name!r} (known: {', '.join(KINDS)})")
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    if a.rounds > 1 and a.prefix_routing:
        ap.error("--rounds applies to the server comparison, not to --prefix-routing")
    a.engine_args = dict(_engine_arg(x) for x in a.engine_arg)
    return a


def _engine_arg(text: str) -> tuple[str, str | int | float | bool]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise SystemExit(f"--engine-arg wants KEY=VALUE, got {text!r}")
    value: str | int | float | bool = raw
    if raw.lower() in ("true", "false"):
        value = raw.lower() == "true"
    else:
        for cast in (int, float):
            try:
                value = cast(raw)
                break
            except ValueError:
                continue
    return key, value


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    engine = EngineConfig(
        max_model_len=a.max_model_len,
        dtype=a.dtype or ("bfloat16" if a.gpu else "float32"),
        max_num_seqs=a.max_num_seqs,
        enable_prefix_caching=not a.no_prefix_caching,
        pin_cores=not a.no_pin_cores,
        extra_args=a.engine_args,
    )
    model = BenchModel(str(Path(a.model_dir).resolve()), engine, use_gpu=a.gpu)
    meta = {
        "argv": vars(a) | {"out": str(a.out)},
        "engine": engine.model_dump(mode="json"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "load_at_start": load_avg(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    model_info = Path(a.model_dir) / "raystack-random-model.json"
    if model_info.exists():
        meta["model"] = json.loads(model_info.read_text())
    rounds: list[dict[str, Any]] = []
    if a.kv_routing:
        from loadtests import kv_bench, kv_routing

        kv_doc = kv_bench.run(a, model) | {"meta": meta | {"load_at_end": load_avg()}}
        (a.out / "bench.json").write_text(json.dumps(kv_doc, indent=2) + "\n")
        print(kv_routing.report(kv_doc, a.out) + f"\n\nwritten: {a.out / 'bench.json'}, {a.out / 'bench.md'}")
        return
    if a.prefix_routing:
        results = run_prefix_routing(a, model)
        base, title = "power_of_two", f"prefix_affinity vs power_of_two ({a.prefixes} x {a.prefix_chars}-char prefixes)"
    else:
        rounds = run_servers(a, model)
        results = rounds[0]["results"]
        if len(rounds) > 1:
            results = {k: median_rows([r["results"][k] for r in rounds]) for k in a.servers}
        base, title = "bare", "bare vLLM vs stock Ray Serve LLM vs ours"
        if len(rounds) > 1:
            title += f" (medians of {len(rounds)} rounds)"
    meta["load_at_end"] = load_avg()
    doc: dict[str, Any] = {"meta": meta, "results": results}
    if len(rounds) > 1:
        doc["rounds"] = rounds
    (a.out / "bench.json").write_text(json.dumps(doc, indent=2) + "\n")
    plot(results, a.out / "bench.png", title)
    table = ratio_table(results, base)
    if len(rounds) > 1:
        table = f"Medians of {len(rounds)} rounds:\n\n{table}"
        if base in a.servers and len(a.servers) > 1:
            table += "\n\nEach round against " + base + ":\n\n" + rounds_table(rounds, base)
    table += "\n\nCores used per group of processes:\n\n" + cpu_table(results)
    (a.out / "bench.md").write_text(table + "\n")
    print(table)
    print(
        f"load average: {meta['load_at_start']:.1f} at start, {meta['load_at_end']:.1f} at end; "
        f"written: {a.out / 'bench.json'}, {a.out / 'bench.png'}, {a.out / 'bench.md'}"
    )


if __name__ == "__main__":
    main()
