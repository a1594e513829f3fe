"""The KV-routing benchmark's pure parts (loadtests.kv_routing, and vllm-router's command line in
loadtests.kv_bench): workloads, cache sizing, the engines' prefix-cache counters and the table. No
engine is started."""

from __future__ import annotations

import argparse
import socket
import time
from pathlib import Path

import pytest

from loadtests.kv_bench import EVENT_PORTS, adapters_for, engine_kv_events, router_command
from loadtests.kv_routing import (
    BLOCK_TOKENS,
    HITS,
    QUERIES,
    CacheSizing,
    counter_deltas,
    engine_counters,
    kv_table,
    level_row,
    median_levels,
    prompts,
    request_names,
    size_cache,
)
from loadtests.models import build_model
from loadtests.servers import BenchModel, our_stack_config
from serving.config import EngineConfig, LoraSlots, parse_config
from serving.control.serve_config import adapter_bases
from serving.manifest import MANIFEST
from serving.registry import manifest_at, sha256_file


def test_pressure_prompts_share_block_aligned_prefixes_and_unique_user_turns() -> None:
    ps = prompts("pressure", 200, prefixes=5, prefix_blocks=2, user_chars=24, seed=1)
    prefix_chars = 2 * BLOCK_TOKENS - 1  # with <bos>, exactly two blocks
    assert all(len(p) == prefix_chars + 24 for p in ps)
    heads = {p[:prefix_chars] for p in ps}
    assert len(heads) == 5  # every prefix drawn, none other
    assert len({h[: BLOCK_TOKENS - 1] for h in heads}) == 5  # distinct from their first block on
    assert len({p[prefix_chars:] for p in ps}) == 200  # the user turn never repeats
    assert ps == prompts("pressure", 200, prefixes=5, prefix_blocks=2, user_chars=24, seed=1)  # same sequence


def test_distinct_prompts_share_no_block() -> None:
    ps = prompts("distinct", 50, prefixes=5, prefix_blocks=2, user_chars=24)
    assert all(len(p) == 2 * BLOCK_TOKENS - 1 + 24 for p in ps)
    assert len({p[: BLOCK_TOKENS - 1] for p in ps}) == 50
    with pytest.raises(ValueError, match="unknown workload"):
        prompts("mixed", 1, 1, 1, 1)


def test_cache_sizing_overflows_one_engine_and_fits_both() -> None:
    blocks = size_cache(prefixes=14, prefix_blocks=8, in_flight=8)
    assert blocks == 60  # (112 + 8) / 2
    sizing = CacheSizing(14, 8, blocks)
    assert sizing.prefix_demand == 112 and sizing.headroom == 8
    assert sizing.problems(in_flight=8, max_model_len=1152) == []
    assert "fit one engine" in CacheSizing(4, 8, 60).problems(8, 1152)[0]
    assert "for 8 requests in flight" in CacheSizing(15, 8, 60).problems(8, 1152)[0]
    assert "fewer than max_model_len 2048" in CacheSizing(14, 8, 12).problems(0, 2048)[-1]


METRICS = """# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="bench"} 2304.0
vllm:prefix_cache_hits_created{engine="0",model_name="bench"} 1.79e+09
vllm:prefix_cache_queries_total{engine="0",model_name="bench"} 3400.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="bench"} 7.0
"""


def test_engine_counters_read_vllms_prefix_cache_counters_only() -> None:
    assert engine_counters(METRICS) == {HITS: 2304.0, QUERIES: 3400.0}
    assert engine_counters("") == {HITS: 0.0, QUERIES: 0.0}


def test_counter_deltas_give_hit_rate_and_split_per_engine() -> None:
    before = {"a": {HITS: 100.0, QUERIES: 200.0}, "b": {HITS: 0.0, QUERIES: 0.0}}
    after = {"a": {HITS: 400.0, QUERIES: 600.0}, "b": {HITS: 0.0, QUERIES: 1200.0}}
    d = counter_deltas(before, after)
    assert d["engines"]["a"] == {"hits": 300.0, "queries": 400.0, "hit_rate": 0.75, "query_share": 0.25}
    assert d["engines"]["b"]["query_share"] == 0.75 and d["engines"]["b"]["hit_rate"] == 0.0
    assert d["hit_rate"] == 300 / 1600 and d["max_query_share"] == 0.75
    idle = counter_deltas(after, after)
    assert idle["hit_rate"] == 0.0 and idle["max_query_share"] == 0.0


def _row(rps: float, ttft: float, hits: float, conc: int = 8) -> dict[str, object]:
    level = {"concurrency": conc, "requests_per_s": rps, "ttft_p50_ms": ttft, "ttft_p99_ms": 2 * ttft}
    level |= {"itl_p50_ms": 5.0, "failures": 0, "errors": []}
    cache = counter_deltas(
        {"e0": {HITS: 0.0, QUERIES: 0.0}, "e1": {HITS: 0.0, QUERIES: 0.0}},
        {"e0": {HITS: hits, QUERIES: 100.0}, "e1": {HITS: hits, QUERIES: 100.0}},
    )
    return level_row(level, cache)


def test_median_levels_and_table() -> None:
    rounds = [_row(10.0, 100.0, 50.0), _row(12.0, 300.0, 70.0), _row(11.0, 200.0, 60.0)]
    for r, cores in zip(rounds, (0.2, 0.4, 0.3), strict=True):
        r["cores_by_group"] = {"engine core": 1.8, "gateway replica": cores} if cores < 0.4 else {"engine core": 1.6}
    m = median_levels(rounds)
    assert m["cores_by_group"] == {"engine core": 1.8, "gateway replica": 0.2}  # 0.3, 0.2 and a round with none
    assert m["requests_per_s"] == 11.0 and m["ttft_p50_ms"] == 200.0 and m["prefix_hit_rate"] == 0.6
    assert m["requests_per_s_rounds"] == [10.0, 12.0, 11.0] and m["rounds"] == 3 and m["concurrency"] == 8
    results = {
        "power_of_two": {"pressure": [_row(10.0, 400.0, 50.0)], "distinct": [_row(5.0, 900.0, 0.0)]},
        "vllm-router": {"pressure": [_row(10.5, 100.0, 95.0)]},
    }
    table = kv_table(results).splitlines()
    assert table[0].startswith("| workload | router | conc | req/s | TTFT p50 ms")
    assert table[2].startswith("| pressure | power_of_two | 8 | 10.00 | 400 | 800 | 5.00 | 50% | 50% |")
    assert "| pressure | vllm-router | 8 | 10.50 (1.05x) | 100 (0.25x) |" in table[3]
    assert "50% q, 95% hit / 50% q, 95% hit" in table[3]
    assert table[4].startswith("| distinct | power_of_two | 8 | 5.00 | 900 |")
    assert len(table) == 5


def test_vllm_router_command_subscribes_to_each_engines_events() -> None:
    urls = ["http://127.0.0.1:8041", "http://127.0.0.1:8042"]
    cmd = router_command(urls, "kv_aware", 8030, "tok", "bench", ("--log-level", "debug"))
    assert cmd[0].endswith("vllm-router") and cmd[cmd.index("--policy") + 1] == "kv_aware"
    assert cmd[cmd.index("--worker-urls") + 1 : cmd.index("--policy")] == urls
    assert cmd[cmd.index("--api-key") + 1] == "tok" and "--log-level" in cmd
    sources = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--kv-event-source"]
    assert sources == [f"{u}=tcp://127.0.0.1:{p}" for u, p in zip(urls, EVENT_PORTS, strict=True)]
    assert cmd[cmd.index("--kv-event-block-size") + 1] == str(BLOCK_TOKENS)
    assert cmd[cmd.index("--kv-event-model") + 1] == "bench"
    plain = router_command(urls, "power_of_two", 8030, "tok", "bench")
    assert "--kv-event-source" not in plain and "--kv-event-model" not in plain


def test_engine_kv_events_bind_on_loopback_where_the_router_connects() -> None:
    """vLLM binds a PUB endpoint only with ``*`` or ``::`` in it (else it connects, as the router
    does, and no event flows); the IPv4-mapped loopback form binds 127.0.0.1 alone."""
    zmq = pytest.importorskip("zmq")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kv = engine_kv_events(port)
    assert kv["publisher"] == "zmq" and kv["enable_kv_cache_events"] is True
    assert "::" in kv["endpoint"] and "*" not in kv["endpoint"]
    ctx = zmq.Context()
    try:
        pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
        pub.bind(kv["endpoint"])
        assert pub.getsockopt_string(zmq.LAST_ENDPOINT) == f"tcp://127.0.0.1:{port}"
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{port}")  # as router_command's --kv-event-source
        deadline = time.monotonic() + 5
        while not sub.poll(50):  # a SUB joins late: publish until it hears one
            assert time.monotonic() < deadline
            pub.send_multipart([b"", (0).to_bytes(8, "big"), b"x"])
        assert sub.recv_multipart()[2] == b"x"
    finally:
        ctx.destroy(linger=0)


def test_adapter_runs_serve_random_adapters_on_the_bench_model(tmp_path: Path) -> None:
    """``--kv-adapters``: real peft adapters of a real (tiny) model, whose manifests the stack's
    config build accepts as adapters of the benchmark's base, each text under every adapter."""
    model_dir = build_model(tmp_path / "models" / "tiny", "tiny")
    engine = EngineConfig(max_model_len=512, dtype="float32")
    a = argparse.Namespace(kv_adapters=2, out=tmp_path / "run")
    model = BenchModel(str(model_dir), engine, lora=LoraSlots(max_loras=2, max_cpu_loras=2, max_lora_rank=8))
    adapters = adapters_for(a, model)
    assert sorted(adapters) == ["bench-lora-0", "bench-lora-1"]
    manifest = manifest_at(adapters["bench-lora-0"])
    assert manifest is not None and manifest.adapter is not None and manifest.adapter.rank == 8
    assert manifest.base is not None
    assert manifest.base.ref == "bench@v1" and manifest.base.manifest_sha256 == sha256_file(model_dir / MANIFEST)
    cfg = parse_config(our_stack_config(model, 8021, replicas=2, router="kv_aware", adapters=adapters))
    assert cfg.models[0].lora == model.lora and [m.base for m in cfg.models[1:]] == ["bench", "bench"]
    assert adapter_bases(cfg, read_manifests=True) == {("bench-lora-0", "v1"): "v1", ("bench-lora-1", "v1"): "v1"}
    names = request_names(sorted(adapters), 400)
    assert names == request_names(sorted(adapters), 400) and set(names) == set(adapters)
    # the same adapter, built again, is the same folder (a second run reuses it)
    assert adapters_for(a, model) == adapters
