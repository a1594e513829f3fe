"""Load-test tooling without a server: scenario files, request bodies, stream accounting, SLO
evaluation on a synthetic Locust CSV, and the benchmark's table (issue 7/8)."""

from __future__ import annotations

import csv
import json
import os
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from loadtests.bench import parse_args, server_variant
from loadtests.bench_tables import ratio_table
from loadtests.client import percentile
from loadtests.report import format_summary, history_series, plot_history
from loadtests.scenario import SLO, ScenarioError, load_scenario, scenario_names
from loadtests.servers import BenchModel, our_stack_config
from loadtests.slo import evaluate, exit_code, load_results, parse_stats
from loadtests.workload import RequestFactory, StreamMeter, outcome_of_body, shared_prefixes
from serving.config import EngineConfig, parse_config

PCTS = ["50%", "66%", "75%", "80%", "90%", "95%", "98%", "99%", "99.9%", "99.99%", "100%"]
STATS_COLS = [
    "Type",
    "Name",
    "Request Count",
    "Failure Count",
    "Median Response Time",
    "Average Response Time",
    "Min Response Time",
    "Max Response Time",
    "Average Content Size",
    "Requests/s",
    "Failures/s",
    *PCTS,
]


def _row(kind: str, name: str, n: int, fails: int, rps: float, size: float, p50: float, p99: float) -> dict[str, str]:
    row = dict.fromkeys(STATS_COLS, "0")
    row |= {
        "Type": kind,
        "Name": name,
        "Request Count": str(n),
        "Failure Count": str(fails),
        "Requests/s": str(rps),
        "Average Content Size": str(size),
    }
    for p in PCTS:
        row[p] = str(p99 if p in ("99%", "99.9%", "99.99%", "100%") else p50)
    return row


def _write_csv(path: Path, rows: list[dict[str, str]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


SYNTHETIC = [
    _row("POST", "chat adder", 300, 3, 10.0, 8.0, 200, 900),
    _row("POST", "completion subtractor", 100, 0, 3.0, 6.0, 150, 700),
    _row("TTFT", "chat adder", 297, 0, 9.9, 0, 40, 300),
    _row("TTFT", "ALL", 397, 0, 13.0, 0, 45, 320),
    _row("ITL", "ALL", 397, 0, 13.0, 0, 5, 20),
    _row("", "Aggregated", 1191, 3, 39.0, 4, 50, 800),
]


@pytest.mark.parametrize("name", scenario_names())
def test_shipped_scenarios_validate_and_have_slos(name: str) -> None:
    sc = load_scenario(name)
    assert sc.name == name
    assert sc.duration_s > 0 and sc.slo.ttft_p99_ms and sc.slo.min_tokens_per_s is not None
    assert sc.users_at(0) is not None and sc.users_at(sc.duration_s + 1) is None


def test_expected_scenarios_exist() -> None:
    assert {"single-model", "multi-model", "shared-prefix", "burst", "smoke"} <= set(scenario_names())
    burst = load_scenario("burst")
    users = [s.users for s in burst.shape]
    assert max(users) >= 4 * min(users), "a burst scenario needs a burst"
    prefix = load_scenario("shared-prefix").requests[0].shared_prefix
    assert prefix is not None and prefix.chars >= 300


def test_smoke_scenario_fits_the_integration_models() -> None:
    sc = load_scenario("smoke")
    assert {r.model for r in sc.requests} <= {"adder", "subtractor"}
    assert all(r.max_tokens <= 8 for r in sc.requests) and sc.duration_s < 40


def test_invalid_scenario_names_file_and_field(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("name: bad\nrequests: [{name: a, model: m, max_tokns: 3}]\nshape: [{duration_s: 5, users: 1}]\n")
    with pytest.raises(ScenarioError, match=r"(?s)bad.yaml.*requests\[a\].max_tokns"):  # by name, as configs
        load_scenario(p)
    p.write_text("name: bad\nrequests: [{name: a, model: m}]\nshape: []\n")
    with pytest.raises(ScenarioError, match="shape"):
        load_scenario(p)
    with pytest.raises(ScenarioError, match="no such scenario"):
        load_scenario("does-not-exist")


def test_shape_scaling_keeps_the_burst_form() -> None:
    sc = load_scenario("burst")
    short = sc.scaled(30)
    assert short.duration_s == pytest.approx(30)
    assert [s.users for s in short.shape] == [s.users for s in sc.shape]
    first = short.shape[0].duration_s
    assert short.users_at(first - 0.01)[0] == sc.shape[0].users
    assert short.users_at(first + 0.01)[0] == sc.shape[1].users
    assert sc.with_model("bench").requests[0].model == "bench"


def test_request_bodies() -> None:
    sc = load_scenario("shared-prefix")
    f = RequestFactory(sc.requests[0], random.Random(1))
    body = f.body()
    assert f.path == "/v1/chat/completions"
    system, user = body["messages"]
    assert system["role"] == "system" and system["content"] in shared_prefixes(sc.requests[0].shared_prefix)
    assert len(system["content"]) == 400 and len(user["content"]) == 24
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["ignore_eos"]
    comp = RequestFactory(load_scenario("smoke").requests[1], random.Random(2)).body()
    a, b = comp["prompt"].rstrip("=").split("-")
    assert 10 <= int(a) <= 99 and 10 <= int(b) <= 99 and comp["max_tokens"] == 6


def test_stream_meter_times_tokens_and_reads_usage() -> None:
    m = StreamMeter(started=10.0)
    m.line('data: {"choices":[{"delta":{"role":"assistant","content":"4"}}]}', 10.2)
    m.line("", 10.2)
    m.line('data: {"choices":[{"delta":{"content":"2"}}]}', 10.3)
    m.line('data: {"choices":[{"delta":{"content":"!"}}]}', 10.4)
    m.line('data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3}}', 10.4)
    m.line("data: [DONE]", 10.41)
    out = m.outcome(10.5)
    assert out.ok and out.tokens == 3 and out.prompt_tokens == 7
    assert out.ttft_s == pytest.approx(0.2) and out.itl_s == pytest.approx(0.1) and out.latency_s == pytest.approx(0.5)


def test_stream_meter_failures() -> None:
    cut = StreamMeter(0.0)
    cut.line('data: {"choices":[{"text":"1"}]}', 0.1)
    assert not cut.outcome(0.2).ok and "DONE" in cut.outcome(0.2).error
    err = StreamMeter(0.0)
    err.line('data: {"choices":[{"text":"1"}]}', 0.1)
    err.line('data: {"error":{"message":"replica failed","type":"server_error"}}', 0.2)
    err.line("data: [DONE]", 0.2)
    assert err.outcome(0.3).error == "replica failed"
    bad = outcome_of_body(429, b'{"error":{"message":"Rate limit","type":"rate_limit_error"}}', 0.0, 0.1)
    assert not bad.ok and bad.error == "HTTP 429: Rate limit"
    good = outcome_of_body(200, b'{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}', 0.0, 0.1)
    assert good.ok and good.tokens == 2


def test_slo_evaluation_on_a_synthetic_csv(tmp_path: Path) -> None:
    _write_csv(tmp_path / "locust_stats.csv", SYNTHETIC)
    r = load_results(tmp_path)
    assert (r.requests, r.failures) == (400, 3)
    assert r.error_rate == pytest.approx(0.0075)
    assert r.tokens_per_s == pytest.approx(10 * 8 + 3 * 6)
    assert r.requests_per_s == pytest.approx(13.0)
    assert (r.ttft_p50_ms, r.ttft_p99_ms, r.itl_p50_ms) == (45, 320, 5)

    ok = evaluate(r, SLO(max_error_rate=0.01, ttft_p99_ms=500, min_tokens_per_s=90, itl_p50_ms=10))
    assert exit_code(ok) == 0 and len(ok) == 5
    broken = {
        "error rate": SLO(max_error_rate=0.005),
        "ttft_p99_ms": SLO(ttft_p99_ms=300),
        "ttft_p50_ms": SLO(ttft_p50_ms=40),
        "tokens_per_s": SLO(min_tokens_per_s=99),
        "finished requests": SLO(min_requests=401),
    }
    for name, slo in broken.items():
        checks = evaluate(r, slo)
        assert exit_code(checks) == 1
        assert [c.name for c in checks if not c.ok] == [name]
    assert "FAIL  ttft_p99_ms: 320 (limit 300)" in format_summary("x", r, evaluate(r, SLO(ttft_p99_ms=300)))


def test_slo_without_data_fails() -> None:
    empty = parse_stats([_row("", "Aggregated", 0, 0, 0, 0, 0, 0) | {"50%": "N/A", "99%": "N/A"}])
    checks = evaluate(empty, SLO(ttft_p99_ms=1000))
    assert exit_code(checks) == 1
    assert {c.name for c in checks if not c.ok} == {"finished requests", "error rate", "ttft_p99_ms"}


def test_history_series_and_plot(tmp_path: Path) -> None:
    cols = [
        "Timestamp",
        "User Count",
        "Type",
        "Name",
        "Requests/s",
        "Failures/s",
        *PCTS,
        "Total Request Count",
        "Total Failure Count",
        "Total Median Response Time",
        "Total Average Response Time",
        "Total Min Response Time",
        "Total Max Response Time",
        "Total Average Content Size",
    ]
    rows = []
    for i in range(6):
        base = dict.fromkeys(cols, "0") | {"Timestamp": str(1000 + i), "User Count": str(4)}
        rows.append(
            base
            | {
                "Type": "POST",
                "Name": "chat adder",
                "Total Request Count": str(10 * i),
                "Total Average Content Size": "8.0",
                "Total Failure Count": "0",
            }
        )
        rows.append(
            base | {"Type": "TTFT", "Name": "ALL", "Total Request Count": str(10 * i), "50%": "40", "99%": "90"}
        )
    _write_csv(tmp_path / "locust_stats_history.csv", rows)
    s = history_series(rows)
    assert [v for _, v in s["requests/s"]][-1] == pytest.approx(10)
    assert [v for _, v in s["tokens/s"]][-1] == pytest.approx(80)
    assert s["TTFT p99"][-1] == (5, 90)
    png = plot_history(tmp_path, "synthetic", tmp_path / "p.png")
    assert png.stat().st_size > 10_000


def test_percentile_nearest_rank() -> None:
    vals = [float(i) for i in range(1, 101)]
    assert percentile(vals, 50) == 50 and percentile(vals, 99) == 99 and percentile(vals, 100) == 100
    assert percentile([], 50) is None and percentile([3.0], 99) == 3.0


def test_bench_stack_config_is_valid_and_mirrors_the_engine() -> None:
    engine = EngineConfig(max_model_len=512, dtype="float32", max_num_seqs=64)
    model = BenchModel("/tmp/m", engine)
    cfg = parse_config(our_stack_config(model, 8021, replicas=2, router="prefix_affinity"))
    m = cfg.models[0]
    assert m.engine == engine and m.deployment.num_replicas == 2 and m.deployment.router == "prefix_affinity"
    assert cfg.auth.mode == "open" and cfg.gateway.port == 8021 and cfg.local_ray.gcs_port != 6379
    kw = model.engine_kwargs()
    assert kw["dtype"] == "float32" and kw["max_model_len"] == 512 and kw["enable_prefix_caching"] is True


def test_a_gateway_setting_is_a_server_of_its_own_in_the_same_rounds() -> None:
    base, stack = server_variant("ours@max_migrations=0+retries=1")
    assert base == "ours" and stack == {"gateway": {"max_migrations": 0, "retries": 1}}
    assert server_variant("bare") == ("bare", {})
    model = BenchModel("/tmp/m", EngineConfig(max_model_len=512, dtype="float32"))
    cfg = parse_config(our_stack_config(model, 8021, **stack))
    assert cfg.gateway.max_migrations == 0 and cfg.gateway.retries == 1 and cfg.gateway.port == 8021
    a = parse_args(["--model-dir", "/tmp/m", "--servers", "ours,ours@max_migrations=0,bare"])
    assert a.servers == ["ours", "ours@max_migrations=0", "bare"]
    for bad in ("bare@max_migrations=0", "nginx", "ours@max_migrations"):
        with pytest.raises(SystemExit):
            parse_args(["--model-dir", "/tmp/m", "--servers", bad])


def test_ratio_table() -> None:
    row = {"concurrency": 8, "failures": 0, "load_before": 1.0, "ttft_p99_ms": 80.0, "itl_p50_ms": 4.0}
    results = {
        "bare": [row | {"requests_per_s": 20.0, "output_tokens_per_s": 1280.0, "ttft_p50_ms": 40.0}],
        "ours": [row | {"requests_per_s": 18.0, "output_tokens_per_s": 1152.0, "ttft_p50_ms": 50.0}],
    }
    table = ratio_table(results)
    assert "| ours | 8 | 18.00 (0.90x) | 1152 (0.90x) | 50 (1.25x) |" in table
    assert "| bare | 8 | 20.00 | 1280 | 40 |" in table


def test_rounds_alternate_the_order_and_report_medians() -> None:
    from loadtests.bench_tables import median_rows, round_orders, rounds_table

    assert round_orders(["ours", "bare"], 3) == [["ours", "bare"], ["bare", "ours"], ["ours", "bare"]]

    def row(c: int, rps: float, ttft: float, fails: int = 0) -> dict[str, object]:
        return {
            "concurrency": c,
            "requests_per_s": rps,
            "ttft_p50_ms": ttft,
            "failures": fails,
            "load_before": 1.0,
            "cores_by_group": {"engine core": rps / 100},
        }

    rounds = [
        {"order": ["ours", "bare"], "results": {"ours": [row(8, 88.0, 20.0)], "bare": [row(8, 110.0, 14.0)]}},
        {"order": ["bare", "ours"], "results": {"ours": [row(8, 80.0, 30.0, 1)], "bare": [row(8, 100.0, 15.0)]}},
        {"order": ["ours", "bare"], "results": {"ours": [row(8, 95.0, 18.0)], "bare": [row(8, 90.0, 16.0)]}},
    ]
    med = median_rows([r["results"]["ours"] for r in rounds])
    assert med == [
        {
            "concurrency": 8,
            "rounds": 3,
            "requests_per_s": 88.0,
            "ttft_p50_ms": 20.0,
            "failures": 1,
            "load_before": 1.0,
            "cores_by_group": {"engine core": 0.88},
            "requests_per_s_rounds": [88.0, 80.0, 95.0],
        }
    ]
    lines = rounds_table(rounds).splitlines()
    assert (
        lines[0]
        == "| round (order) | conc | ours req/s / bare | ours TTFT p50 - bare | ours failures | bare failures |"
    )
    assert lines[2] == "| 1 (ours,bare) | 8 | 0.80x | +6 ms | 0 | 0 |"
    assert lines[3] == "| 2 (bare,ours) | 8 | 0.80x | +15 ms | 1 | 0 |"
    assert lines[4] == "| 3 (ours,bare) | 8 | 1.06x | +2 ms | 0 | 0 |"
    # the median of the per-round ratios (each pair measured close in time), not the ratio of
    # the medians (88 / 100)
    assert lines[5] == "| median | 8 | **0.80x** | **+6 ms** | 1 in all | 0 in all |"
    assert len(lines) == 6  # every median over all rounds: no footnote


def test_bench_runs_each_round_in_its_order_and_writes_the_medians(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``python -m loadtests.bench --rounds 2`` with servers that only note their start: each
    round starts every server in its order (ABBA) and the files hold each round and the medians.
    The real servers run in tests/e2e/test_bench.py (one round)."""
    from contextlib import contextmanager

    from loadtests import bench

    started: list[str] = []
    figures = iter([10.0, 11.0, 20.0, 22.0, 30.0, 33.0, 40.0, 44.0])  # requests/s, in measuring order

    def measure(server: Any, make: Any, path: str, levels: list[int], *_: Any) -> list[dict[str, Any]]:
        assert path == "/v1/completions" and make() is not None
        rows = []
        for c in levels:
            rps = next(figures)
            rows.append(
                {"concurrency": c, "requests": 8, "failures": 0, "requests_per_s": rps, "output_tokens_per_s": rps * 64}
                | {"ttft_p50_ms": 100 / rps, "ttft_p99_ms": 200 / rps, "itl_p50_ms": 2.0, "itl_p99_ms": 3.0}
                | {"load_before": 1.0, "cores_by_group": {"engine core": 0.9, "benchmark client": 0.3}}
            )
        return rows

    @contextmanager
    def running(server: Any, timeout: float) -> Any:
        yield server

    monkeypatch.setattr(bench, "make_server", lambda kind, *a, **k: started.append(kind) or SimpleNamespace(proc=None))
    monkeypatch.setattr(bench, "running", running)
    monkeypatch.setattr(bench, "measure", measure)
    monkeypatch.setattr(bench, "prompt_pool", lambda *a, **k: ["12+30="])
    out = tmp_path / "out"
    argv = ["--model-dir", str(tmp_path), "--out", str(out), "--servers", "ours,bare", "--rounds", "2"]
    bench.main([*argv, "--concurrency", "1", "4", "--requests", "8", "--settle-s", "0"])
    assert started == ["ours", "bare", "bare", "ours"]
    doc = json.loads((out / "bench.json").read_text())
    assert [r["order"] for r in doc["rounds"]] == [["ours", "bare"], ["bare", "ours"]]
    assert [r["requests_per_s"] for r in doc["rounds"][1]["results"]["ours"]] == [40.0, 44.0]
    ours = doc["results"]["ours"]
    assert [(r["rounds"], r["requests_per_s"], r["requests_per_s_rounds"]) for r in ours] == [
        (2, 25.0, [10.0, 40.0]),
        (2, 27.5, [11.0, 44.0]),
    ]
    table = (out / "bench.md").read_text()
    assert table.startswith("Medians of 2 rounds") and "| 2 (bare,ours) | 4 |" in table and "| median | 4 |" in table
    assert (out / "bench.png").stat().st_size > 10_000


def test_char_tokenizer_and_exact_length_prompts(tmp_path: Path) -> None:
    from loadtests.models import build_tokenizer
    from loadtests.workload import prompt_pool

    tok = build_tokenizer(vocab_size=300, max_length=1024)
    assert len(tok) == 300
    assert len(tok("ab c")["input_ids"]) == 5  # <bos> + one token per character
    tok.save_pretrained(str(tmp_path))
    prompts = prompt_pool(str(tmp_path), tokens=16, n=3)
    assert len(set(prompts)) == 3 and all(len(tok(p)["input_ids"]) == 16 for p in prompts)


def test_cpu_split_groups_processes_by_role() -> None:
    from loadtests.cpuprof import cpu_by_group, group_of, split

    assert group_of("VLLM::Worker", "") == "engine worker"
    assert group_of("python3", "python3 -m vllm.entrypoints.launchers.api_server.entry --model m") == "vLLM API server"
    assert group_of("ray::ServeRepli", "ray::ServeReplica:gateway:Gateway") == "gateway replica"
    assert group_of("ray::ServeRepli", "ray::ServeReplica:default:OpenAiIngress") == "gateway replica"
    assert group_of("ray::ServeRepli", "ray::ServeReplica:bench--v1:bench--v1") == "model replica"
    assert group_of("ray::ProxyActor", "ray::ProxyActor") == "Serve proxy"
    assert group_of("raylet", "/x/raylet --foo") == "Ray daemons"
    assert group_of("vllm::router", "vllm::router") == "vllm-router"
    assert group_of("python", "python -m loadtests.bench --routers vllm-router:random") == "benchmark client"
    before = {1: ("gateway replica", 10.0), 2: ("Ray daemons", 5.0)}
    after = {1: ("gateway replica", 12.0), 2: ("Ray daemons", 5.5), 3: ("other", 1.0)}  # 3 started meanwhile
    assert split(before, after, 4.0) == {"gateway replica": 0.5, "other": 0.25, "Ray daemons": 0.125}
    me = cpu_by_group()  # this very process is in the real table
    assert os.getpid() in me and me[os.getpid()][1] > 0


def test_cpuprof_command_prints_cores_per_group(capsys: pytest.CaptureFixture[str]) -> None:
    import threading

    from loadtests.cpuprof import main

    stop = threading.Event()
    spin = threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)])  # busy: "other" > 0
    spin.start()
    try:
        main(["--seconds", "0.5"])
    finally:
        stop.set()
        spin.join()
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("total") and "(over 0.5 s)" in lines[-1]
    assert float(lines[-1].split()[1]) > 0.2 and any(line.startswith("other") for line in lines)


def test_affinity_by_group_reads_the_real_processes() -> None:
    from loadtests.cpuprof import affinity_by_group

    got = affinity_by_group(groups=("other",))  # this test process is in "other"
    assert set(got["other"]) >= os.sched_getaffinity(0)
    assert affinity_by_group(groups=("no such group",)) == {}


def test_an_untitled_engine_core_is_found_as_its_api_servers_child() -> None:
    """Without ``setproctitle`` vLLM's EngineCore keeps its API server's command line (forked):
    the pinning and the benchmark still find it, as the API server's one multiprocessing child."""
    import subprocess
    import sys
    import time

    from loadtests.cpuprof import affinity_by_group, engine_processes
    from serving.replica.placement import engine_core_pid

    server = "import os, time; os.fork(); time.sleep(60)"  # parent and child sleep alike
    api = subprocess.Popen([sys.executable, "-c", server, "vllm.entrypoints.launchers.api_server.entry"])
    try:
        deadline = time.monotonic() + 20
        while (core := engine_core_pid(api.pid)) is None:
            assert time.monotonic() < deadline, "the forked stand-in did not start"
            time.sleep(0.05)
        assert core != api.pid
        mine = {p["pid"]: p["group"] for p in engine_processes() if p["pid"] in (api.pid, core)}
        assert mine == {api.pid: "vLLM API server", core: "engine core"}
        assert set(affinity_by_group()["engine core"]) >= os.sched_getaffinity(core)
    finally:
        subprocess.run(["pkill", "-P", str(api.pid)], check=False)
        api.kill()
        api.wait()


def test_cpu_table_lists_the_groups_seen() -> None:
    from loadtests.bench_tables import cpu_table

    rows = {
        "bare": [{"concurrency": 8, "cores_by_group": {"engine worker": 1.0, "vLLM API server": 0.5}}],
        "ours": [{"concurrency": 8, "cores_by_group": {"engine worker": 0.9, "gateway replica": 0.3}}],
    }
    out = cpu_table(rows).splitlines()
    assert out[0] == "| server | conc | engine worker | vLLM API server | gateway replica | total |"
    assert out[2] == "| bare | 8 | 1.00 | 0.50 | 0.00 | 1.50 |"
    assert out[3] == "| ours | 8 | 0.90 | 0.00 | 0.30 | 1.20 |"


def test_relay_benchmark_runs_the_gateway_against_its_synthetic_replica(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m loadtests.relay`` end to end with tiny numbers: both processes start, every
    request is relayed, and it prints the gateway's CPU per request (a figure, not a threshold)."""
    from loadtests.relay import main

    assert main(["--requests", "30", "--concurrency", "3", "--chunks", "4", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "4 chunks per request, 3 clients" in out
    line = next(ln for ln in out.splitlines() if "ms CPU/request" in ln)
    assert "failures 0" in line and "nan" not in line


def test_lora_bench_memory_and_ratios() -> None:
    from loadtests.lora_bench import parse_rollup, ratio_rows, ratios_table

    rollup = "55d0-7ffd [rollup]\nRss:              204800 kB\nPss:              102400 kB\nPss_Anon:  1 kB\n"
    assert parse_rollup(rollup) == {"Rss": 204800, "Pss": 102400}
    assert parse_rollup("") == {"Rss": 0, "Pss": 0}

    def level(rps: float, ttft: float, itl: float) -> dict[str, float]:
        return {"requests_per_s": rps, "ttft_p50_ms": ttft, "itl_p50_ms": itl}

    def rnd(on_rps: float) -> dict[str, object]:
        return {
            "round": 1,
            "order": ["off", "shared", "split"],
            "results": {
                "off": {"base": level(100, 10, 1.0), "memory": {"pss_mib": 1000}},
                "shared": {"base": level(on_rps, 20, 2.0), "mix": level(30, 5, 1), "memory": {"pss_mib": 1100}},
                "split": {"mix": level(20, 5, 1), "memory": {"pss_mib": 2200}},
            },
        }

    rows = ratio_rows([rnd(50), rnd(70)])
    assert rows[0] == {
        "base_rps_on_off": 0.5,
        "base_ttft_p50_on_off": 2.0,
        "base_itl_p50_on_off": 2.0,
        "mix_rps_shared_split": 1.5,
        "pss_shared_split": 0.5,
        "pss_on_off": 1.1,
    }
    table = ratios_table([rnd(50), rnd(70)])
    assert "| median | **0.60** | **2.00** |" in table  # the median of 0.5 and 0.7
