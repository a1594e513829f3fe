"""The KV-routing benchmark's pure parts: its two workloads, the cache sizing, the engines'
prefix-cache counters, the adapters' draw and the tables (no engine, no network;
:mod:`loadtests.kv_bench` runs them).

Workloads, in tokens of the benchmark models' character-level tokenizer (:mod:`loadtests.models`:
one token per character, ``<bos>`` first), so that block boundaries are known exactly:

- ``pressure``: each prompt is one of ``prefixes`` long shared prefixes, chosen at random, then a
  short user turn unique to the request. ``<bos>`` plus a prefix fill exactly ``prefix_blocks``
  KV blocks of :data:`BLOCK_TOKENS`, so every prefix block can be a cache hit and the user turn
  never shares a block with it.
- ``distinct``: prompts of the same length with nothing shared (each begins with its own index).

Cache sizing: the prefixes' blocks together must exceed one engine's KV cache (so no engine can
hold them all, and a router that spreads every prefix over both engines keeps evicting) but fit
the engines' combined cache with room left for the blocks of the requests in flight (so a router
that keeps each prefix on one engine can hit on nearly every request). :func:`size_cache` picks
the block count per engine (vLLM's ``num_gpu_blocks_override``) and :class:`CacheSizing` checks
both conditions.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtests.bench_tables import cpu_table
from loadtests.cpuprof import median_cores
from loadtests.workload import random_text

__all__ = [
    "BLOCK_TOKENS",
    "HITS",
    "QUERIES",
    "CacheSizing",
    "counter_deltas",
    "engine_counters",
    "kv_table",
    "level_row",
    "median_levels",
    "prompts",
    "report",
    "request_names",
    "size_cache",
    "token_prompts",
]

BLOCK_TOKENS = 128  # vLLM's KV block size on CPU (``block_size`` in its vllm:cache_config_info)
HITS = "vllm:prefix_cache_hits_total"  # tokens served from the prefix cache (vLLM 0.32)
QUERIES = "vllm:prefix_cache_queries_total"  # prompt tokens looked up in it
WORKLOADS = ("pressure", "distinct")


@dataclass(frozen=True)
class CacheSizing:
    """``prefixes`` shared prefixes of ``prefix_blocks`` full blocks each, against engines of
    ``blocks_per_engine`` blocks."""

    prefixes: int
    prefix_blocks: int
    blocks_per_engine: int
    engines: int = 2
    block_tokens: int = BLOCK_TOKENS

    @property
    def prefix_demand(self) -> int:
        """Blocks that every prefix cached once takes."""
        return self.prefixes * self.prefix_blocks

    @property
    def headroom(self) -> int:
        """Blocks of the combined cache left over when every prefix is cached once."""
        return self.engines * self.blocks_per_engine - self.prefix_demand

    def problems(self, in_flight: int, max_model_len: int) -> list[str]:
        """Why this sizing does not put the caches under pressure as intended (empty: it does).
        ``in_flight``: requests running at once over all engines (each holds one block of its
        own beyond the prefix); ``max_model_len``: vLLM refuses to start if one request of that
        length does not fit an engine's cache."""
        out = []
        if self.prefix_demand <= self.blocks_per_engine:
            out.append(f"the prefixes' {self.prefix_demand} blocks fit one engine's {self.blocks_per_engine}")
        if self.headroom < in_flight:
            out.append(
                f"the prefixes' {self.prefix_demand} blocks leave {self.headroom} of the engines' "
                f"{self.engines * self.blocks_per_engine} for {in_flight} requests in flight"
            )
        if self.blocks_per_engine * self.block_tokens < max_model_len:
            out.append(
                f"{self.blocks_per_engine} blocks of {self.block_tokens} tokens "
                f"are fewer than max_model_len {max_model_len}"
            )
        return out


def size_cache(prefixes: int, prefix_blocks: int, in_flight: int, engines: int = 2) -> int:
    """Blocks per engine: the fewest that hold every prefix once over all engines plus one block
    per request in flight, so that one engine holds well under all of them."""
    return math.ceil((prefixes * prefix_blocks + in_flight) / engines)


def prompts(workload: str, n: int, prefixes: int, prefix_blocks: int, user_chars: int, seed: int = 0) -> list[str]:
    """``n`` prompts of ``workload`` (see the module docstring), the same for the same arguments.
    Every prompt has ``prefix_blocks * BLOCK_TOKENS - 1 + user_chars`` characters."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r} (known: {', '.join(WORKLOADS)})")
    rng = random.Random(seed)
    prefix_chars = prefix_blocks * BLOCK_TOKENS - 1  # <bos> is the block's first token

    def filled(head: str, chars: int) -> str:
        return (head + random_text(rng, chars))[:chars]

    if workload == "distinct":
        return [filled(f"request {k}: ", prefix_chars + user_chars) for k in range(n)]
    shared = [filled(f"system {i}: ", prefix_chars) for i in range(prefixes)]
    return [rng.choice(shared) + filled(f"user {k}: ", user_chars) for k in range(n)]


def engine_counters(metrics_text: str) -> dict[str, float]:
    """The prefix-cache counters of one engine's ``/metrics`` (summed over label sets)."""
    out = {HITS: 0.0, QUERIES: 0.0}
    for line in metrics_text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def counter_deltas(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Per engine (by name) and in total, the prefix-cache hits and queries between two scrapes:
    ``hit_rate`` (hit tokens / queried tokens) and ``query_share`` (the engine's part of all
    queried tokens: 0.5 each is an even split over two engines)."""
    engines: dict[str, dict[str, float]] = {}
    for name in sorted(after):
        b = before.get(name, {})
        hits = after[name].get(HITS, 0.0) - b.get(HITS, 0.0)
        queries = after[name].get(QUERIES, 0.0) - b.get(QUERIES, 0.0)
        engines[name] = {"hits": hits, "queries": queries}
    total_q = sum(e["queries"] for e in engines.values())
    total_h = sum(e["hits"] for e in engines.values())
    for e in engines.values():
        e["hit_rate"] = e["hits"] / e["queries"] if e["queries"] else 0.0
        e["query_share"] = e["queries"] / total_q if total_q else 0.0
    return {
        "engines": engines,
        "hit_rate": total_h / total_q if total_q else 0.0,
        "max_query_share": max((e["query_share"] for e in engines.values()), default=0.0),
    }


def level_row(level: dict[str, Any], cache: dict[str, Any]) -> dict[str, Any]:
    """One measured level (``LevelResult.as_dict()``) with its prefix-cache deltas."""
    return {**level, "prefix_hit_rate": cache["hit_rate"], "max_query_share": cache["max_query_share"], "cache": cache}


def median_levels(per_round: list[dict[str, Any]]) -> dict[str, Any]:
    """One level's row over several rounds: the median of every numeric figure over the rounds
    that have it (failures summed), each round's requests/s and TTFT p50 kept; ``figure_rounds``
    (only when some round lacks a figure, e.g. no TTFT where every request failed) how many
    rounds each such median is over."""
    out: dict[str, Any] = {"rounds": len(per_round)}
    partial: dict[str, int] = {}
    for key in dict.fromkeys(k for r in per_round for k in r):
        raw = [r.get(key) for r in per_round]
        if key == "cores_by_group":
            out[key] = median_cores(per_round)
            continue
        values = [v for v in raw if isinstance(v, (int, float))]
        if any(isinstance(v, bool) for v in raw) or not values:
            continue
        if not all(v is None or isinstance(v, (int, float)) for v in raw):
            continue
        out[key] = sum(values) if key == "failures" else statistics.median(values)
        if len(values) < len(raw) and key != "failures":
            partial[key] = len(values)
    out["concurrency"] = per_round[0]["concurrency"]
    out["requests_per_s_rounds"] = [r["requests_per_s"] for r in per_round]
    out["ttft_p50_ms_rounds"] = [r.get("ttft_p50_ms") for r in per_round]
    if partial:
        out["figure_rounds"] = partial
    return out


def _split(row: dict[str, Any]) -> str:
    engines = (row.get("cache") or {}).get("engines") or {}
    if not engines:
        return "-"
    return " / ".join(f"{e['query_share']:.0%} q, {e['hit_rate']:.0%} hit" for e in engines.values())


def kv_table(results: dict[str, dict[str, list[dict[str, Any]]]], base: str = "power_of_two") -> str:
    """Markdown table: per workload, router and concurrency, requests/s and TTFT p50 (each with
    its ratio to ``base``), TTFT p99, ITL p50, the engines' prefix-cache hit rate, and per engine
    its share of the queried tokens and its own hit rate (the last only for a single round). "-"
    for a figure the level lacks (no TTFT when every request failed); a median over fewer rounds
    than all (``figure_rounds`` of :func:`median_levels`) gets a footnote."""
    notes: list[str] = []

    def ratio(v: float | None, b: float | None) -> str:
        return f" ({v / b:.2f}x)" if v is not None and b else ""

    def fig(row: dict[str, Any], key: str, fmt: str, what: str, then: str = "") -> str:
        v = row.get(key)
        if v is None:
            return "-"
        have = row.get("figure_rounds", {}).get(key)
        if not have:
            return fmt.format(v) + then
        notes.append(f"[{len(notes) + 1}] {what}: median over {have} of {row['rounds']} rounds (the others lack it)")
        return fmt.format(v) + then + f" [{len(notes)}]"

    head = (
        "| workload | router | conc | req/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | prefix hits "
        "| busier engine's share | per engine | failures |"
    )
    lines = [head, "|" + "---|" * 11]
    workloads = [w for w in WORKLOADS if any(w in per for per in results.values())]
    for w in workloads:
        for router, per in results.items():
            ref = {r["concurrency"]: r for r in results.get(base, {}).get(w, [])}
            for row in per.get(w, []):
                b = ref.get(row["concurrency"], {}) if router != base else {}
                rps, ttft, at = row["requests_per_s"], row.get("ttft_p50_ms"), f"{w} {router} {row['concurrency']}"
                cells = [
                    f"{rps:.2f}{ratio(rps, b.get('requests_per_s'))}",
                    fig(row, "ttft_p50_ms", "{:.0f}", f"{at} TTFT p50", ratio(ttft, b.get("ttft_p50_ms"))),
                    fig(row, "ttft_p99_ms", "{:.0f}", f"{at} TTFT p99"),
                    fig(row, "itl_p50_ms", "{:.2f}", f"{at} ITL p50"),
                    f"{row.get('prefix_hit_rate', 0):.0%}",
                    f"{row.get('max_query_share', 0):.0%}",
                    _split(row),
                    str(row.get("failures", 0)),
                ]
                lines.append(f"| {w} | {router} | {row['concurrency']} | " + " | ".join(cells) + " |")
    return "\n".join(lines + ([""] + notes if notes else []))


def request_names(adapters: list[str], n: int, seed: int = 1) -> list[str]:
    """The adapter each of ``n`` requests asks for, at random, the same for the same arguments."""
    rng = random.Random(seed)
    return [rng.choice(adapters) for _ in range(n)]


def report(doc: dict[str, Any], out: Path) -> str:
    """bench.md: the medians, then each round's table (which has the per-engine split)."""
    base = "power_of_two" if "power_of_two" in doc["results"] else next(iter(doc["results"]))
    rounds = doc["rounds"]
    text = f"Medians of {len(rounds)} round(s):\n\n" + kv_table(doc["results"], base)
    by_level = {f"{r} {w}": rows for r, per in doc["results"].items() for w, rows in per.items()}
    text += "\n\nCores used per group of processes (medians):\n\n" + cpu_table(by_level)
    for i, rnd in enumerate(rounds, 1):
        text += f"\n\nRound {i} ({','.join(rnd['order'])}):\n\n" + kv_table(rnd["results"], base)
    (out / "bench.md").write_text(text + "\n")
    return text


def token_prompts(model_dir: str, texts: list[str]) -> list[list[int]]:
    """Each prompt as the token ids the engine makes of it (``add_special_tokens``, as vLLM's
    completions endpoint tokenizes a text prompt)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [list(tok(t)["input_ids"]) for t in texts]
