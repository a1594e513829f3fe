"""router: kv_aware on the running stack: the gateways route a repeated long prefix to the replica
whose engine reports the prefix-cache hits, from the engines' own KV events."""

from __future__ import annotations

import httpx
import pytest

from serving.metrics import parse_prometheus_values
from tests.conftest import Stack
from tests.integration.raytools import ray_run

pytestmark = pytest.mark.integration

APP = "adder-kv--v1"
RECORDS = """
from serving.gateway.replicas import RayKV, read_records
print(json.dumps([r.__dict__ | {"adapters": sorted(r.adapters)} for r in read_records(RayKV())]))
"""
HITS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")


def _counters(record: dict[str, str]) -> dict[str, float]:
    text = httpx.get(f"{record['url']}/metrics", headers={"authorization": f"Bearer {record['token']}"}).text
    return parse_prometheus_values(text, set(HITS))


def _chat(stack: Stack, system: str, user: str) -> httpx.Response:
    body = {
        "model": "adder-kv",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 2,
        "temperature": 0,
    }
    r = httpx.post(f"{stack.url}/v1/chat/completions", json=body, headers=stack.headers(), timeout=120)
    assert r.status_code == 200, r.text
    return r


def test_a_repeated_long_prefix_goes_to_the_replica_whose_engine_has_it_cached(stack: Stack) -> None:
    records = {r["replica"]: r for r in ray_run(stack, RECORDS) if r["app"] == APP}
    assert len(records) == 2 and all(r["events"] for r in records.values()), records
    before = {rep: _counters(rec) for rep, rec in records.items()}
    prefixes = [f"Session {k}: you add two numbers and answer with the sum only. " * 12 for k in range(4)]
    served: dict[int, list[str]] = {}
    for i in range(6):  # the two gateway replicas take turns; both index both engines' streams
        for k, system in enumerate(prefixes):
            r = _chat(stack, system, f"{i}+{k}=")
            served.setdefault(k, []).append(r.headers["x-replica"])
            assert r.json()["usage"]["prompt_tokens"] > 2 * 128  # at least two full CPU blocks
    for k, where in served.items():
        assert len(set(where)) == 1, (k, where)  # every repeat of a prefix on the replica that has it
    after = {rep: _counters(rec) for rep, rec in records.items()}
    for rep in records:
        repeats = sum(len(w) - 1 for w in served.values() if w[0] == rep)
        hits = after[rep][HITS[0]] - before[rep][HITS[0]]
        # each repeat found its prefix's two full blocks in that engine's cache
        assert hits >= repeats * 2 * 128, (rep, hits, repeats)
    assert len({w[0] for w in served.values()}) == 2, served  # four prefixes, balanced over both
