"""router: kv_aware on the running stack: the gateways route a repeated long prefix to the replica
whose engine reports the prefix-cache hits, from the engines' own KV events; an adapter's blocks
carry its name in the engine's events as in the gateway's keys, and the tenant's cache salt too;
one tenant's cached prefix is never reused for another tenant's request."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from serving.contract import Record
from serving.gateway.admission.auth import tenant_cache_salt
from serving.gateway.kv_index import KVFeeds
from serving.metrics import parse_prometheus_values
from tests.conftest import Stack
from tests.integration.raytools import endpoint_records

pytestmark = pytest.mark.integration

APP = "adder-kv--v1"
HITS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")


def _counters(record: dict[str, str]) -> dict[str, float]:
    text = httpx.get(f"{record['url']}/metrics", headers={"authorization": f"Bearer {record['token']}"}).text
    return parse_prometheus_values(text, set(HITS))


def _body(system: str, user: str, model: str = "adder-kv") -> dict:
    return {
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 2,
        "temperature": 0,
    }


def _chat(stack: Stack, system: str, user: str, model: str = "adder-kv") -> httpx.Response:
    body = _body(system, user, model)
    r = httpx.post(f"{stack.url}/v1/chat/completions", json=body, headers=stack.headers(), timeout=120)
    assert r.status_code == 200, r.text
    return r


def test_a_repeated_long_prefix_goes_to_the_replica_whose_engine_has_it_cached(stack: Stack) -> None:
    records = {r["replica"]: r for r in endpoint_records(stack, APP)}
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


async def _engine_state(records: list[Record], system: str, adapter: str) -> dict[str, tuple[int, int]]:
    """What a gateway replica started now learns from the engines' block streams (each engine's
    whole state first): per replica, how many of the prompt's leading blocks it holds keyed with
    ``adapter`` and keyed as the base's."""
    feeds = KVFeeds()
    feeds.sync(records)
    # as the gateway sends it: with the cache salt of the tenant whose requests filled the cache
    body = _body(system, "1-1=") | {"cache_salt": tenant_cache_salt("main")}
    try:
        for _ in range(600):
            keys = feeds.keys(APP, "chat", body, adapter)
            if keys and all(feeds.index.blocks_held(APP, r.replica) for r in records):
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # every stream's first line read
        with_adapter = feeds.keys(APP, "chat", body, adapter)
        as_base = feeds.keys(APP, "chat", body, None)
        assert with_adapter and as_base and len(with_adapter) >= 2
        # no pending routes in this index: a match is what an engine reported
        return {
            r.replica: (feeds.index.matched(APP, r.replica, with_adapter), feeds.index.matched(APP, r.replica, as_base))
            for r in records
        }
    finally:
        feeds.stop()
        await asyncio.sleep(0)


def test_an_adapters_blocks_carry_its_name_in_the_engines_events_and_the_gateways_keys(stack: Stack) -> None:
    """vLLM keys an adapter's blocks apart from the base's (``lora_name`` in its events): the
    gateway's keys for an adapter request must be those, or adapter traffic routes by load only."""
    system = "Adapter session: you subtract the second number from the first, answer only. " * 10
    replies = [_chat(stack, system, f"{40 + i}-{i}=", model="kv-lora") for i in range(3)]
    assert replies[0].json()["usage"]["prompt_tokens"] > 2 * 128  # at least two full CPU blocks
    served = [r.headers["x-replica"] for r in replies]
    assert len(set(served)) == 1, served  # repeats go to the replica that holds the adapter and prefix
    records = [Record(**(r | {"adapters": frozenset(r["adapters"])})) for r in endpoint_records(stack, APP)]
    state = asyncio.run(_engine_state(records, system, "kv-lora@v1"))
    assert state[served[0]][0] >= 2, state  # the engine's events, keyed with the adapter's name
    assert all(base == 0 for _, base in state.values()), state  # never as the base's blocks


def test_one_tenants_cached_prefix_is_not_reused_for_another_tenants_request(stack: Stack) -> None:
    """Two tenants send the same long prompt to the same engine (one session, so one replica of
    ``adder``): the second tenant's request finds none of the first's blocks in the engine's cache
    (its time to first token cannot tell that the prompt was sent before), while the first
    tenant's own repeat finds them all."""
    records = {r["replica"]: r for r in endpoint_records(stack, "adder--v1")}
    system = "Tenant note: the vault code is 4417; you add two numbers and answer with the sum only. " * 10

    def chat(tenant: str) -> str:
        for _ in range(4):  # the limited tenant allows 4 requests per 10 s window
            r = httpx.post(
                f"{stack.url}/v1/chat/completions",
                json=_body(system, "2+2=", model="adder"),
                headers=stack.headers(tenant) | {"x-session-id": "cache-salt-test"},
                timeout=120,
            )
            if r.status_code != 429:
                break
            time.sleep(float(r.headers.get("retry-after", "2")))
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] > 2 * 128  # at least two full CPU blocks
        return r.headers["x-replica"]

    replica = chat("main")
    hits = [_counters(records[replica])[HITS[0]]]
    for tenant in ("limited", "main"):
        assert chat(tenant) == replica  # the session keeps both on one engine
        hits.append(_counters(records[replica])[HITS[0]])
    assert hits[1] - hits[0] < 128, hits  # the other tenant: not one block of main's prompt
    assert hits[2] - hits[1] >= 2 * 128, hits  # main's own repeat: its prompt's blocks
