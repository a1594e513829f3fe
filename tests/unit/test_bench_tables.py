"""The benchmarks' tables when a round lacks a figure (every request failed), and the LoRA
benchmark's traffic with more adapters than the old fixed four prompt chunks allowed. Pure
functions only: no server is started."""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any, cast

from loadtests.kv_routing import kv_table, median_levels
from loadtests.servers import Server


def test_a_round_where_every_request_failed_invents_no_figure() -> None:
    """Round 2: every request to ours answered HTTP 503, so ours has no TTFT and 0 requests/s.
    Its TTFT must not count as 0 (a -10 ms difference, a -4 ms median), its failures show, and the
    medians are over the rounds that have the figure, with a footnote saying so."""
    from loadtests.bench_tables import median_rows, ratio_table, rounds_table

    def row(rps: float, ttft: float | None, fails: int = 0) -> dict[str, Any]:
        return {"concurrency": 8, "requests_per_s": rps, "ttft_p50_ms": ttft, "ttft_p99_ms": ttft, "failures": fails}

    rounds: list[dict[str, Any]] = [
        {"order": ["ours", "bare"], "results": {"ours": [row(100.0, 12.0)], "bare": [row(100.0, 10.0)]}},
        {"order": ["bare", "ours"], "results": {"ours": [row(0.0, None, 40)], "bare": [row(100.0, 10.0)]}},
    ]
    lines = rounds_table(rounds).splitlines()
    assert lines[3] == "| 2 (bare,ours) | 8 | 0.00x | - | 40 | 0 |"
    assert lines[4] == "| median | 8 | **0.50x** | **+2 ms** [1] | 40 in all | 0 in all |"
    assert lines[6] == "[1] ours TTFT p50 - bare at conc 8: median over 1 of 2 rounds (the others lack it)"
    assert not any("-4 ms" in ln or "-10 ms" in ln for ln in lines)

    med = {k: median_rows([r["results"][k] for r in rounds]) for k in ("ours", "bare")}
    ours = med["ours"][0]
    assert ours["ttft_p50_ms"] == 12.0 and ours["requests_per_s"] == 50.0 and ours["failures"] == 40
    assert ours["figure_rounds"] == {"ttft_p50_ms": 1, "ttft_p99_ms": 1}
    assert "figure_rounds" not in med["bare"][0]
    table = ratio_table({k: [r | {"load_before": 1.0} for r in rows] for k, rows in med.items()})
    assert "| ours | 8 | 50.00 (0.50x) | - | 12 (1.20x) [1] | 12 (1.20x) [2] | - | 40 | 1.0 |" in table
    assert "[2] ours TTFT p99 ms at conc 8: median over 1 of 2 rounds (the others lack it)" in table

    # a round with no figure on the bare side, or no bare requests at all, gives "-", not nan
    rounds[1]["results"] = {"ours": [row(90.0, 11.0)], "bare": [row(0.0, None, 40)]}
    assert rounds_table(rounds).splitlines()[3] == "| 2 (bare,ours) | 8 | - | - | 0 | 40 |"


def test_kv_medians_skip_a_round_without_ttft_and_the_table_shows_dash() -> None:
    def level(rps: float, ttft: float | None, fails: int = 0) -> dict[str, Any]:
        return (
            {"concurrency": 8, "requests_per_s": rps, "ttft_p50_ms": ttft, "ttft_p99_ms": ttft}
            | {"itl_p50_ms": None if ttft is None else 5.0, "failures": fails, "errors": []}
            | {"prefix_hit_rate": 0.5, "max_query_share": 0.5, "cache": {}}
        )

    failed = level(0.0, None, 40)
    m = median_levels([level(10.0, 100.0), failed, level(12.0, 300.0)])
    assert m["ttft_p50_ms"] == 200.0 and m["itl_p50_ms"] == 5.0 and m["failures"] == 40
    assert m["requests_per_s"] == 10.0 and m["ttft_p50_ms_rounds"] == [100.0, None, 300.0]
    assert m["figure_rounds"] == {"ttft_p50_ms": 2, "ttft_p99_ms": 2, "itl_p50_ms": 2}
    table = kv_table({"power_of_two": {"pressure": [level(10.0, 50.0)]}, "kv": {"pressure": [failed, m]}})
    lines = table.splitlines()
    assert lines[3].startswith("| pressure | kv | 8 | 0.00 (0.00x) | - | - | - | 50% | 50% | - | 40 |")
    assert lines[4].startswith("| pressure | kv | 8 | 10.00 (1.00x) | 200 (4.00x) [1] | 200 [2] | 5.00 [3] |")
    assert "[1] pressure kv 8 TTFT p50: median over 2 of 3 rounds (the others lack it)" in lines


def _lora_args(adapters: int) -> argparse.Namespace:
    return argparse.Namespace(
        adapters=[(f"a{i}@v1", f"/ckpt/a{i}") for i in range(adapters)],
        base_name="adder@v1",
        output_tokens=4,
        concurrency=2,
        requests=6,
    )


def test_lora_traffic_gives_every_target_its_own_prompts_with_four_adapters() -> None:
    from loadtests.lora_bench import traffic

    a = _lora_args(4)
    prompts = [f"p{i}" for i in range(20)]  # four per target: the base and four adapters
    shared = cast(Server, SimpleNamespace(base_url="http://127.0.0.1:8041", api_key="k"))
    split = [cast(Server, SimpleNamespace(base_url=f"http://127.0.0.1:{8041 + i}", api_key="k")) for i in range(4)]
    for config, servers in (("shared", [shared]), ("split", split)):
        levels = traffic(config, servers, a, prompts)
        targets = levels.get("base", []) + levels["mix"]
        seen = [{t.make_body()["prompt"] for _ in range(8)} for t in targets]
        assert [len(s) for s in seen] == [4] * len(targets)
        assert len(set().union(*seen)) == 4 * len(targets)  # no prompt shared by two targets
        assert [t.make_body()["model"] for t in levels["mix"]] == [n for n, _ in a.adapters]


def test_lora_pool_and_engine_count_follow_the_adapters() -> None:
    from loadtests.bench import WARMUP_REQUESTS
    from loadtests.lora_bench import figures_table, pool_size

    assert pool_size(_lora_args(4)) == 5 * (WARMUP_REQUESTS + 2 + 6)
    assert pool_size(_lora_args(1)) == 2 * (WARMUP_REQUESTS + 2 + 6)

    def level(ttft: float | None) -> dict[str, Any]:
        return {"requests_per_s": 10.0, "ttft_p50_ms": ttft, "itl_p50_ms": ttft, "failures": 0}

    mem = {"memory": {"pss_mib": 1000.0, "rss_mib": 2000.0}}
    results = {"off": {"base": level(5.0)} | mem, "shared": {"base": level(None), "mix": level(6.0)} | mem}
    rnd = {"round": 1, "order": ["off", "shared", "split"], "results": results | {"split": {"mix": level(5.0)} | mem}}
    lines = figures_table([rnd], 4).splitlines()
    assert "| 1 | split | 4 | mix | 10.00 | 5 | 5.00 | 0 | 1000 | 2000 |" in lines
    assert "| 1 | shared | 1 | base | 10.00 | - | - | 0 | 1000 | 2000 |" in lines
    from loadtests.lora_bench import ratios_table

    table = ratios_table([rnd]).splitlines()  # shared's base had no TTFT: no ratio, no crash
    assert table[2] == "| 1 (off,shared,split) | 1.00 | - | - | 1.00 | 1.00 | 1.00 |"
    assert table[3] == "| median | **1.00** | - | - | **1.00** | **1.00** | **1.00** |"
