"""Routing for reuse, measured: two engines under each router, on a workload whose shared prefixes
overflow one engine's KV cache but fit both (``pressure``) and on one with nothing shared
(``distinct``); run as ``python -m loadtests.bench --kv-routing`` (:mod:`loadtests.bench` parses the
options, :mod:`loadtests.kv_routing` holds the workloads, sizing and tables).

Routers (``--routers``, comma-separated):

- ``power_of_two``, ``prefix_affinity``, ``kv_aware``, ...: this stack with two replicas under
  that ``router:`` setting (any name :data:`serving.config.RouterName` accepts).
- ``vllm-router`` (its ``kv_aware`` policy) or ``vllm-router:POLICY``: vLLM's Rust router
  (PyPI ``vllm-router``, the ``bench`` extra) in front of two bare vLLM engines started with our
  replicas' command line and placement, each publishing its KV events on a loopback ZMQ socket
  that only the router subscribes to.

With ``--kv-adapters N`` every request goes to one of N random LoRA adapters of the model
(:func:`loadtests.models.build_adapter`, built under ``--out``, registered on both replicas): the
pressure workload's prefixes are ``--kv-prefixes / N`` texts, each asked under every adapter, so
the same text under two adapters is two cached prefixes (vLLM keys an adapter's blocks by its
name). vllm-router is left out there: its index keys blocks by token ids alone.

Every router serves the same request sequence per workload; the engines' KV caches are sized
with ``num_gpu_blocks_override`` (``--cache-blocks``, by default :func:`size_cache`). Before and
after each measured level each engine's ``/metrics`` is read for its prefix-cache counters, so
the hit rate and how the queried tokens split over the engines are in the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import secrets
import shutil
import subprocess
import sys
import time
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from loadtests.bench_tables import round_orders
from loadtests.client import run_level
from loadtests.cpuprof import cpu_by_group, load_avg, split
from loadtests.kv_routing import (
    BLOCK_TOKENS,
    CacheSizing,
    counter_deltas,
    engine_counters,
    level_row,
    median_levels,
    prompts,
    request_names,
    size_cache,
    token_prompts,
)
from loadtests.models import ADAPTER_RANK, build_adapter
from loadtests.servers import (
    ROOT,
    BenchModel,
    Server,
    _base_env,
    make_server,
    running,
    stop_session,
    wait_serving,
)
from loadtests.workload import completion_bodies
from serving.config import LoraSlots, RouterName

__all__ = ["add_arguments", "check_arguments", "run"]

VLLM_ROUTER = "vllm-router"
ROUTER_PORT, ENGINE_PORTS, EVENT_PORTS = 8030, (8041, 8042), (5571, 5572)
GCS_ADDRESS = "127.0.0.1:6393"  # the private Ray of our bench stack (servers.our_stack_config)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("KV routing (--kv-routing)")
    g.add_argument("--kv-routing", action="store_true", help="routers compared on cache pressure, 2 engines each")
    g.add_argument(
        "--routers",
        default="power_of_two,prefix_affinity,kv_aware,vllm-router",
        help="ours: any router: setting; vllm-router (kv_aware policy) or vllm-router:POLICY",
    )
    g.add_argument("--workloads", default="pressure,distinct", help="pressure, distinct")
    g.add_argument("--kv-prefixes", type=int, default=14, help="shared prefixes of the pressure workload")
    g.add_argument("--prefix-blocks", type=int, default=8, help=f"KV blocks ({BLOCK_TOKENS} tokens) per prefix")
    g.add_argument("--user-chars", type=int, default=32, help="the unique user turn after the prefix")
    g.add_argument("--cache-blocks", type=int, default=0, help="KV blocks per engine (0: size_cache)")
    g.add_argument("--kv-warmup", type=int, default=0, help="unrecorded requests per level (0: 2 per prefix)")
    g.add_argument(
        "--kv-adapters",
        type=int,
        default=0,
        help="requests to this many random LoRA adapters of the model (0: the model itself)",
    )
    g.add_argument(
        "--prompt-form",
        choices=("auto", "text", "tokens"),
        default="auto",
        help="what the client sends: auto = token ids to vllm-router (it tokenizes nothing), text to ours",
    )


def check_arguments(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Split the lists; refuse a router this checkout's config does not know before anything starts."""
    a.routers = [r.strip() for r in a.routers.split(",") if r.strip()]
    a.workloads = [w.strip() for w in a.workloads.split(",") if w.strip()]
    a.kv_warmup = a.kv_warmup or 2 * a.kv_prefixes
    if not a.kv_routing:
        return
    known = typing.get_args(RouterName)
    for r in a.routers:
        if not r.startswith(VLLM_ROUTER) and r not in known:
            ap.error(f"--routers: {r!r} is not a router of this checkout (serving.config.RouterName: {known})")
    if a.kv_adapters:
        if any(r.startswith(VLLM_ROUTER) for r in a.routers):
            ap.error("--kv-adapters: vllm-router keys its index by token ids alone; leave it out of --routers")
        if a.kv_adapters < 1 or a.kv_prefixes % a.kv_adapters:
            ap.error("--kv-adapters must divide --kv-prefixes (each text is asked under every adapter)")
    if any(r.startswith(VLLM_ROUTER) for r in a.routers) and shutil.which(VLLM_ROUTER, path=_bin_dir()) is None:
        ap.error("--routers: vllm-router is not installed (pip install -e '.[bench]')")


def _bin_dir() -> str:
    return str(Path(sys.executable).parent)


@dataclass
class RouterPair:
    """vllm-router in front of two bare engines (one token shared by both, which the client sends
    and the router passes on), each engine publishing KV events on loopback for the router."""

    model: BenchModel
    log_dir: Path
    policy: str
    port: int = ROUTER_PORT
    kind: str = VLLM_ROUTER
    engines: list[Server] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    api_key: str = field(default_factory=lambda: secrets.token_urlsafe(16))
    router_args: tuple[str, ...] = ()  # further vllm-router flags

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float) -> None:
        for k, (port, events) in enumerate(zip(ENGINE_PORTS, EVENT_PORTS, strict=True)):
            extra = {**self.model.engine.extra_args, "kv-events-config": json.dumps(engine_kv_events(events))}
            model = replace(self.model, engine=self.model.engine.model_copy(update={"extra_args": extra}))
            engine = Server("bare", model, self.log_dir / f"engine-{k}", port, api_key=self.api_key)
            self.engines.append(engine)
            engine.start(timeout_s)
        for engine in self.engines:  # both have claimed a core now: the first re-places its API server
            engine.pin_like_ours()
        cmd = router_command(
            [e.base_url for e in self.engines], self.policy, self.port, self.api_key, self.model.name, self.router_args
        )
        env = {**_base_env(False), "VLLM_ROUTER_TOKENIZER": self.model.path, "VLLM_ROUTER_MODEL": self.model.name}
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"{VLLM_ROUTER}.log", "ab") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log, start_new_session=True)
        wait_serving(self.base_url, self.api_key, self.model.name, timeout_s, self.proc)

    def stop(self) -> None:
        if self.proc is not None:
            stop_session(self.proc)
        for engine in reversed(self.engines):
            engine.stop()

    def engine_endpoints(self) -> dict[str, tuple[str, str]]:
        return {f"engine-{k}": (e.base_url, self.api_key) for k, e in enumerate(self.engines)}


def engine_kv_events(port: int) -> dict[str, Any]:
    """An engine's ``--kv-events-config``: its ZMQ PUB socket *bound* on loopback port ``port``.

    vLLM's publisher binds only an endpoint with ``*`` or ``::`` in it and *connects* to any other
    (``ZmqEventPublisher._is_bind_endpoint`` in vllm/distributed/kv_events.py), and vllm-router's
    subscriber always connects (``sub.connect(&pub_endpoint)`` in src/kv_index/subscriber.rs of
    vllm-router 0.1.17). With ``tcp://127.0.0.1:PORT`` both sides connected, nobody listened, no
    event ever reached the router and its index stayed empty (kv_aware then routed by load alone).
    The IPv4-mapped form has the ``::`` that makes vLLM bind, and ZMQ binds it as 127.0.0.1: still
    loopback only (``tcp://*:PORT`` would listen on every interface)."""
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://[::ffff:127.0.0.1]:{port}"}


def router_command(
    worker_urls: list[str], policy: str, port: int, api_key: str, model: str, extra: tuple[str, ...] = ()
) -> list[str]:
    """vllm-router's command line in front of ``worker_urls`` (in the order of ``EVENT_PORTS``)."""
    cmd = [str(Path(_bin_dir()) / VLLM_ROUTER), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--worker-urls", *worker_urls, "--policy", policy]
    cmd += ["--prometheus-port", str(port + 1000)]
    # the token for the engines, which vllm-router sends them in place of the client's (src/routers/
    # http/router.rs: "When a backend api_key is configured it must win"); without it their guard
    # (serving.replica.engine_guard) answers 401. A per-run random token of loopback-only engines;
    # ps shows it while they run. (The "model unknown" it logs is its label for workers that
    # report no model, src/core/worker.rs; the KV index is keyed by --kv-event-model instead.)
    cmd += ["--api-key", api_key, *extra]
    if policy == "kv_aware":
        # vllm-router 0.1.17 recomputes no engine block hash, so neither PYTHONHASHSEED nor
        # --prefix-caching-hash-algo matters: it keys its index by its own sha256 over each block's
        # token ids (kv_index::local_block_hashes in src/kv_index/mod.rs, applied to the token_ids
        # of every BlockStored event in subscriber.rs apply_batch and to the request's token ids in
        # policies/kv_aware.rs prepare_selection) and keeps the engine's hashes only as opaque
        # parent/removal keys. What must agree is the block size (--kv-event-block-size) and that
        # the request carries token ids (see measure_router).
        for url, events in zip(worker_urls, EVENT_PORTS, strict=True):
            cmd += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{events}"]
        # --kv-event-model is required with static sources (vllm-router refuses to start without it)
        cmd += ["--kv-event-block-size", str(BLOCK_TOKENS), "--kv-event-model", model]
    return cmd


def our_engine_endpoints(address: str = GCS_ADDRESS, name: str = "bench") -> dict[str, tuple[str, str]]:
    """Our replicas' engines (url, token) as they publish them in Ray's KV store, read by a short
    Ray driver in a child process (the benchmark itself stays out of Ray)."""
    from serving.control.stack import ray_env

    code = "import sys; from loadtests.kv_bench import _print_records; _print_records(sys.argv[1])"
    out = subprocess.run(
        [sys.executable, "-c", code, address],
        cwd=ROOT,
        env={**_base_env(False), **ray_env(name)},  # the stack's token, and loopback (stack.ray_env)
        capture_output=True,
        text=True,
        timeout=120,
    )
    if out.returncode != 0:
        raise RuntimeError(f"cannot read our replicas' endpoints: {out.stderr[-500:]}")
    return {name: (url, token) for name, url, token in json.loads(out.stdout.strip().splitlines()[-1])}


def _print_records(address: str) -> None:
    import ray

    from serving.contract import RayKV, read_records

    ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    try:
        print(json.dumps(sorted([r.replica, r.url, r.token] for r in read_records(RayKV()))))
    finally:
        ray.shutdown()


def scrape(endpoints: dict[str, tuple[str, str]]) -> dict[str, dict[str, float]]:
    out = {}
    for name, (url, token) in endpoints.items():
        r = httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {token}"}, timeout=30)
        r.raise_for_status()
        out[name] = engine_counters(r.text)
    return out


@dataclass(frozen=True)
class Serving:
    """A started router as the measurement sees it: where to send, and each engine's (url, token)."""

    kind: str
    base_url: str
    api_key: str | None
    engines: dict[str, tuple[str, str]]


@contextmanager
def router_running(
    router: str, model: BenchModel, log_dir: Path, timeout_s: float, adapters: dict[str, str] | None = None
) -> Iterator[Serving]:
    """The server of one router (``adapters``: LoRA adapters of ``model`` ours serves too, name:
    folder); always stopped, even when starting failed half-way."""
    if router.startswith(VLLM_ROUTER):
        pair = RouterPair(model, log_dir / router.replace(":", "-"), router.partition(":")[2] or "kv_aware")
        try:
            pair.start(timeout_s)
            yield Serving(router, pair.base_url, pair.api_key, pair.engine_endpoints())
        finally:
            pair.stop()
        return
    server = make_server("ours", model, log_dir / router, replicas=2, router=router, adapters=adapters)
    with running(server, timeout_s):
        engines = our_engine_endpoints()
        if len(engines) != 2:
            raise RuntimeError(f"expected 2 replica engines in Ray's KV store, found {sorted(engines)}")
        yield Serving(router, server.base_url, server.api_key, engines)


def measure_router(
    a: argparse.Namespace,
    server: Serving,
    model: BenchModel,
    sequences: dict[str, list[str]],
    log: Any,
    names: list[str] | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """Every workload at every concurrency: unrecorded warm-up requests (they fill the caches),
    then the measured ones between two scrapes of the engines' counters. ``names``: the model
    each request asks for (by position in the sequence), else ``model.name`` for all."""
    endpoints = server.engines
    out: dict[str, list[dict[str, Any]]] = {}
    for w in a.workloads:
        seq: list[Any] = sequences[w]
        if a.prompt_form == "tokens" or (a.prompt_form == "auto" and server.kind.startswith(VLLM_ROUTER)):
            # vllm-router 0.1.17 tokenizes nothing on its HTTP path: its kv_aware policy sees a
            # text prompt as no tokens ("missing_tokens") and picks by load alone. The same prompt
            # as token ids (what the engine makes of the text: <bos> + one per character) it scores.
            seq = token_prompts(model.path, seq)
        make = completion_bodies(names or model.name, seq, a.output_tokens)  # the same sequence per router
        rows = []
        for c in a.concurrency:
            asyncio.run(run_level(server.base_url, server.api_key, "/v1/completions", make, c, a.kv_warmup))
            before = scrape(endpoints)
            cpu_before, t0 = cpu_by_group(), time.monotonic()
            r = asyncio.run(run_level(server.base_url, server.api_key, "/v1/completions", make, c, a.requests))
            cores = split(cpu_before, cpu_by_group(), time.monotonic() - t0)
            row = level_row(r.as_dict(), counter_deltas(before, scrape(endpoints))) | {"cores_by_group": cores}
            rows.append(row)
            log(
                f"  {server.kind:12} {w:9} c={c:<3} {r.requests_per_s:6.2f} req/s  TTFT p50 {r.ttft_p50_ms or 0:5.0f} "
                f"p99 {r.ttft_p99_ms or 0:5.0f} ms  hits {row['prefix_hit_rate']:.0%}  busier engine "
                f"{row['max_query_share']:.0%}  failures {r.failures}  load {load_avg():.1f}"
            )
            log("    cores: " + ", ".join(f"{g} {v:.2f}" for g, v in cores.items()))
        out[w] = rows
    return out


def kv_model(a: argparse.Namespace, model: BenchModel) -> tuple[BenchModel, CacheSizing]:
    """The model with the engines' cache sized for the pressure workload and a context that
    holds one prompt and its output; exits when the sizing does not make pressure."""
    in_flight = max(a.concurrency)
    blocks = a.cache_blocks or size_cache(a.kv_prefixes, a.prefix_blocks, in_flight)
    sizing = CacheSizing(a.kv_prefixes, a.prefix_blocks, blocks)
    prompt_tokens = a.prefix_blocks * BLOCK_TOKENS + a.user_chars
    max_len = max(model.engine.max_model_len, -(-(prompt_tokens + a.output_tokens) // BLOCK_TOKENS) * BLOCK_TOKENS)
    problems = sizing.problems(in_flight, max_len)
    if problems:
        raise SystemExit("the cache sizing puts no pressure as intended: " + "; ".join(problems))
    extra = {**model.engine.extra_args, "num-gpu-blocks-override": blocks}
    engine = model.engine.model_copy(update={"max_model_len": max_len, "extra_args": extra})
    return replace(model, engine=engine), sizing


def adapters_for(a: argparse.Namespace, model: BenchModel) -> dict[str, str]:
    """``--kv-adapters`` random LoRA adapters of ``model`` under ``--out``/adapters (name: folder)."""
    out = {}
    for k in range(a.kv_adapters):
        name = f"{model.name}-lora-{k}"
        out[name] = str(build_adapter(model.path, a.out / "adapters", name, f"{model.name}@v1", seed=k).resolve())
    return out


def run(a: argparse.Namespace, model: BenchModel, log: Any = print) -> dict[str, Any]:
    """Every router in turn, ``a.rounds`` times in alternating order; the document bench.json gets."""
    model, sizing = kv_model(a, model)
    adapters = adapters_for(a, model) if a.kv_adapters else {}
    if adapters:
        slots = LoraSlots(max_loras=len(adapters), max_cpu_loras=len(adapters), max_lora_rank=ADAPTER_RANK)
        model = replace(model, lora=slots)
        log(f"adapters: {', '.join(adapters)} (each of the {a.kv_prefixes // len(adapters)} texts under each)")
    log(
        f"cache: {sizing.blocks_per_engine} blocks of {BLOCK_TOKENS} tokens per engine; {sizing.prefixes} prefixes "
        f"x {sizing.prefix_blocks} blocks = {sizing.prefix_demand} blocks; max_model_len {model.engine.max_model_len}"
    )
    n = len(a.concurrency) * (a.kv_warmup + a.requests) + 8  # + wait_serving's and slack
    texts = a.kv_prefixes // max(1, len(adapters))  # each text under every adapter
    sequences = {w: prompts(w, n, texts, a.prefix_blocks, a.user_chars) for w in a.workloads}
    names = request_names(sorted(adapters), n) if adapters else None
    rounds: list[dict[str, Any]] = []
    for i, order in enumerate(round_orders(a.routers, a.rounds), 1):
        results: dict[str, Any] = {}
        for router in order:
            log(f"starting {router} (round {i} of {a.rounds}, load {load_avg():.1f})...")
            t0 = time.monotonic()
            with router_running(router, model, a.out / "logs", a.start_timeout, adapters) as server:
                log(f"  {router} serving after {time.monotonic() - t0:.0f}s")
                time.sleep(a.settle_s)
                results[router] = measure_router(a, server, model, sequences, log, names)
        rounds.append({"order": order, "results": {r: results[r] for r in a.routers}})
    medians = {
        r: {
            w: [median_levels(list(lv)) for lv in zip(*(rd["results"][r][w] for rd in rounds), strict=True)]
            for w in a.workloads
        }
        for r in a.routers
    }
    sized = vars(sizing) | {"prefix_demand": sizing.prefix_demand}
    return {"sizing": sized, "adapters": sorted(adapters), "rounds": rounds, "results": medians}
