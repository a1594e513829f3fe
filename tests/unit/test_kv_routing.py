"""KV-aware routing (``router: kv_aware``): the replica's ledger of engine blocks, the gateway's
index and pick, and the whole relay (vLLM's own zmq publisher -> replica stream -> gateway index)."""

from __future__ import annotations

import asyncio
import os
import random
import secrets

import httpx
import pytest

from serving.config import ConfigError, parse_config
from serving.contract import Record, block_keys, chain_key, publish, read_records
from serving.gateway.kv_index import KVFeeds, KVIndex
from serving.gateway.replicas import EndpointTable
from serving.replica.engine import EngineSpec, vllm_command
from serving.replica.kv_events import BlockLedger, KVEventRelay, private_dir_ok
from serving.replica.node import free_port
from tests.support.kv import MemoryKV

BS = 4  # block size of these tests (vLLM's CPU engine uses 128)


def _stored(hashes: list[int], tokens: list[int], parent: int | None = None, lora: str | None = None) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": lora,
    }


def test_ledger_keys_are_the_keys_the_gateway_computes_from_the_tokens() -> None:
    tokens = list(range(12))
    ledger = BlockLedger()
    first = ledger.apply([_stored([101, 102], tokens[:8])])
    second = ledger.apply([_stored([103], tokens[8:12], parent=102)])  # chained on an engine hash
    assert first["add"] + second["add"] == block_keys(tokens, BS)
    assert ledger.block_size == BS
    # a partial last block has no key: the engine caches full blocks only
    assert block_keys(tokens + [99], BS) == block_keys(tokens, BS)


def test_ledger_removes_clears_and_skips_what_it_cannot_chain() -> None:
    ledger = BlockLedger()
    ledger.apply([_stored([1, 2], list(range(8)))])
    gone = ledger.apply([{"type": "BlockRemoved", "block_hashes": [2, 77], "medium": "CPU"}])
    assert gone["del"] == [block_keys(list(range(8)), BS)[1]] and len(ledger.held) == 1
    orphan = ledger.apply([_stored([9], [5, 5, 5, 5], parent=12345)])  # parent never seen
    assert orphan["add"] == [] and ledger.unkeyed == 1
    cleared = ledger.apply([{"type": "AllBlocksCleared"}])
    assert cleared.get("reset") and ledger.held == []


def test_an_adapters_blocks_are_keyed_apart_from_the_bases() -> None:
    tokens = [7] * BS
    assert block_keys(tokens, BS, "sub-lora@v1") != block_keys(tokens, BS)
    ledger = BlockLedger()
    added = ledger.apply([_stored([5], tokens, lora="sub-lora@v1")])["add"]
    assert added == block_keys(tokens, BS, "sub-lora@v1")
    assert chain_key(None, None, tokens) == block_keys(tokens, BS)[0]


def test_a_requests_cache_salt_keys_its_blocks_as_vllm_publishes_it() -> None:
    """vLLM hashes ``cache_salt`` into a sequence's first block and publishes it, untagged, among
    that block's extra keys (after the adapter's name): the ledger's keys must be the gateway's."""
    from vllm.v1.core.kv_cache_utils import to_event_extra_keys

    tokens = list(range(3 * BS))
    salted = block_keys(tokens, BS, "sub-lora@v1", salt="t1234")
    assert salted != block_keys(tokens, BS, "sub-lora@v1") and salted != block_keys(tokens, BS, "sub-lora@v1", "t9")
    extra = to_event_extra_keys([(("lora", "sub-lora@v1"), ("cache_salt", "t1234")), None, None])
    ledger = BlockLedger()
    added = ledger.apply([_stored([1, 2, 3], tokens, lora="sub-lora@v1") | {"extra_keys": extra}])["add"]
    assert added == salted
    # the base's blocks with a salt and no adapter; a later store chained on them needs no salt
    plain = BlockLedger()
    first = plain.apply([_stored([4], tokens[:BS]) | {"extra_keys": to_event_extra_keys([(("cache_salt", "t1"),)])}])
    later = plain.apply([_stored([5, 6], tokens[BS:], parent=4) | {"extra_keys": [None, None]}])
    assert first["add"] + later["add"] == block_keys(tokens, BS, salt="t1")


def test_the_gateways_keys_include_the_requests_cache_salt() -> None:
    feeds = KVFeeds()
    feeds.index.block_size["m--v1"] = BS

    class Words:
        def tokens(self, kind: str, body: dict) -> list[int]:
            return list(range(2 * BS))

    feeds._prompts["m--v1"] = Words()  # type: ignore[assignment]
    assert feeds.keys("m--v1", "chat", {"cache_salt": "tA"}, None) == tuple(
        block_keys(list(range(2 * BS)), BS, None, "tA")
    )
    assert feeds.keys("m--v1", "chat", {}, None) == tuple(block_keys(list(range(2 * BS)), BS))


def test_index_counts_leading_blocks_held_or_lately_routed() -> None:
    keys = block_keys(list(range(16)), BS)  # 4 blocks
    index = KVIndex(pending_s=5)
    index.reset("m", "r1", BS, keys[:2] + keys[3:])  # a hole at block 2
    assert index.matched("m", "r1", keys, now=0) == 2  # the prefix ends at the first missing block
    index.routed("m", "r2", keys, now=100)
    assert index.matched("m", "r2", keys, now=104) == 4  # sent there, not yet reported
    assert index.matched("m", "r2", keys, now=106) == 0  # never reported: forgotten
    index.apply("m", "r1", [keys[2]], [keys[0]])
    assert index.matched("m", "r1", keys, now=0) == 0
    index.drop("m", "r1")
    assert index.blocks_held("m", "r1") == 0


def _table(*replicas: str) -> tuple[EndpointTable, KVIndex]:
    table = EndpointTable(rng=random.Random(0))
    table.kv_index = index = KVIndex()
    table.update([Record("m", r, f"http://{r}", "t", 1) for r in replicas], now=0)
    return table, index


def test_pick_goes_to_the_replica_holding_the_longest_prefix() -> None:
    table, index = _table("r1", "r2", "r3")
    keys = block_keys(list(range(40)), BS)  # 10 blocks
    index.reset("m", "r2", BS, keys[:3])
    index.reset("m", "r3", BS, keys[:8])
    picks = set()
    for _ in range(5):
        lease = table.pick("m", blocks=keys, now=1)
        assert lease is not None
        picks.add(lease.replica)
        lease.release()
    assert picks == {"r3"}


def test_one_hot_prefix_spills_to_another_replica_under_load() -> None:
    """Held blocks weigh against in-flight requests, so a hot prefix cannot pile every request on
    one replica; once a request has spilled, both replicas hold the prefix and load decides."""
    table, index = _table("r1", "r2")
    keys = block_keys(list(range(12)), BS)  # 3 blocks
    index.reset("m", "r1", BS, keys)
    leases = [table.pick("m", blocks=keys, now=1) for _ in range(8)]
    where = [lease.replica for lease in leases if lease]
    assert where[:4] == ["r1"] * 3 + ["r2"]  # 3 held blocks weigh as much as 3 requests ahead
    assert "r2" in where and abs(where.count("r1") - where.count("r2")) <= 2, where


def test_a_new_prefix_goes_where_the_cache_holds_least() -> None:
    table, index = _table("r1", "r2")
    index.reset("m", "r1", BS, block_keys(list(range(100, 140)), BS))
    index.reset("m", "r2", BS, block_keys(list(range(200, 208)), BS))
    lease = table.pick("m", blocks=block_keys(list(range(8)), BS), now=1)
    assert lease is not None and lease.replica == "r2"


def test_without_keys_or_a_match_the_pick_is_by_load() -> None:
    table, index = _table("r1", "r2")
    busy = table.pick("m", now=1)
    assert busy is not None
    keys = block_keys(list(range(8)), BS)
    other = table.pick("m", blocks=keys, now=1)  # nothing cached anywhere: the idle one
    assert other is not None and other.replica != busy.replica


def test_kv_aware_needs_prefix_caching_and_a_generate_model() -> None:
    def cfg(engine: dict) -> dict:
        return {
            "auth": {"mode": "open"},
            "models": [
                {
                    "name": "m",
                    "versions": [{"version": "v1", "path": "/x"}],
                    "engine": engine,
                    "deployment": {"router": "kv_aware"},
                }
            ],
        }

    parse_config(cfg({}))
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        parse_config(cfg({"enable_prefix_caching": False}))
    with pytest.raises(ConfigError, match="generate model"):
        parse_config(cfg({"runner": "pooling"}))


def test_the_engine_publishes_on_a_private_ipc_socket(tmp_path: object) -> None:
    relay = KVEventRelay("tok", "/nowhere")
    try:
        spec = EngineSpec.model_validate({"model": "m", "version": "v1", "path": "/x", "engine": {}, "kv_events": True})
        cmd = vllm_command(spec, "127.0.0.1", 1, relay.config)
        config = cmd[cmd.index("--kv-events-config") + 1]
        assert f'"endpoint": "ipc://{relay.dir}/events"' in config and "tcp://" not in config
        assert private_dir_ok(relay.dir)
    finally:
        relay.close_sync()
    assert not os.path.exists(relay.dir)


def test_records_carry_the_stream_url() -> None:
    kv = MemoryKV()
    publish(kv, "m--v1", "r1", "http://e", "tok", 3, events="http://e:2")
    assert read_records(kv)[0].events == "http://e:2"


async def test_vllm_events_reach_the_gateway_index_through_the_replica_stream(tmp_path: object) -> None:
    """vLLM's own zmq publisher (the class its engine runs) on the relay's ipc socket; the
    gateway's feed follows the replica's stream over HTTP with the token, a late gateway gets the
    whole state first, and a replica that leaves takes its blocks with it."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher

    (model := tmp_path / "model").mkdir()  # type: ignore[operator]
    (model / "tokenizer.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    token = secrets.token_urlsafe(8)
    relay = KVEventRelay(token, str(model))
    pub = ZmqEventPublisher(0, endpoint=relay.endpoint, replay_endpoint=relay.replay, topic="kv")
    url = await relay.start("127.0.0.1", free_port())
    feeds = late = None
    try:
        async with httpx.AsyncClient() as c:
            assert (await c.get(f"{url}/kv/blocks")).status_code == 401
            assert (await c.get(f"{url}/kv/tokenizer", headers={"authorization": "Bearer nope"})).status_code == 401
            files = (await c.get(f"{url}/kv/tokenizer", headers={"authorization": f"Bearer {token}"})).json()["files"]
            assert set(files) == {"tokenizer.json"}  # never the weights
        record = Record("m--v1", "r1", "http://engine", token, 1, events=url)
        feeds = KVFeeds()
        feeds.sync([record])
        await asyncio.sleep(0.5)  # subscribed
        tokens = list(range(3 * BS))
        stored = BlockStored(
            block_hashes=[b"h1", b"h2", b"h3"],
            parent_block_hash=None,
            token_ids=tokens,
            block_size=BS,
            lora_id=None,
            medium="CPU",
            lora_name=None,
        )
        pub.publish(KVEventBatch(ts=0.0, events=[stored]))
        keys = block_keys(tokens, BS)
        await _until(lambda: feeds.index.matched("m--v1", "r1", keys) == 3)
        pub.publish(KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=[b"h3"], medium="CPU")]))
        await _until(lambda: feeds.index.matched("m--v1", "r1", keys) == 2)
        late = KVFeeds()  # a gateway replica started later
        late.sync([record])
        await _until(lambda: late.index.matched("m--v1", "r1", keys) == 2)
        assert late.index.block_size["m--v1"] == BS
        feeds.sync([])  # the replica's record is gone
        assert feeds.index.matched("m--v1", "r1", keys) == 0
    finally:
        for f in (feeds, late):
            if f is not None:
                f.stop()
        pub.shutdown()
        await relay.stop()
        await asyncio.sleep(0)


async def _until(cond: object, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():  # type: ignore[operator]
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


async def test_a_long_prompt_is_tokenized_for_routing_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokenizing a 1 MB prompt takes about 0.8 s: on the event loop every stream of the gateway
    replica would wait that long. Bodies over KV_INLINE_BYTES are tokenized in a thread."""
    import threading

    from aiohttp import web

    from loadtests.relay import OneReplica
    from serving.config import GatewayConfig
    from serving.contract import LeaseHint
    from serving.control.serve_config import routing_user_config
    from serving.gateway.api import create_api
    from serving.gateway.core import KV_INLINE_BYTES, GatewayCore
    from tests.support.loopback import http_replica

    async def answer(request: web.Request) -> web.Response:
        return web.json_response({"choices": [{"index": 0, "text": "2"}], "usage": {"prompt_tokens": 1}})

    stack = {
        "auth": {"mode": "open"},
        "models": [{"name": "m", "versions": [{"version": "v1"}], "deployment": {"router": "kv_aware"}}],
    }
    threads: list[str] = []
    async with http_replica(answer) as url:
        core = GatewayCore(GatewayConfig(), OneReplica(url))
        core.reconfigure(routing_user_config(parse_config(stack)))

        def hint_for(*args: object) -> LeaseHint:
            threads.append(threading.current_thread().name)
            return LeaseHint()

        monkeypatch.setattr(core, "hint_for", hint_for)
        transport = httpx.ASGITransport(app=create_api(core))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=20) as c:
                for prompt in ("1+1=", "x" * KV_INLINE_BYTES):
                    r = await c.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1})
                    assert r.status_code == 200
        finally:
            await core.aclose()
    main = threading.current_thread().name
    assert threads[0] == main and threads[1] != main
