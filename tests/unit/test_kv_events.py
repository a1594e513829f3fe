"""The replica's KV-block stream (serving/replica/kv_events.py, kv_ledger.py) against vLLM's own
prefix cache and publisher: vLLM's ``KVCacheManager`` (the scheduler's cache) in-process for the
events one engine step sends, its ``ZmqEventPublisher`` and replay socket for lost batches. No
engine is started."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from typing import Any

import msgspec
import pytest

from serving.contract import Record, block_keys
from serving.gateway import kv_index
from serving.gateway.kv_index import KVFeeds, KVIndex
from serving.replica import kv_events
from serving.replica.kv_events import BlockLedger, KVEventRelay, _Stream
from serving.replica.node import free_port

BS = 4


class Engine:
    """vLLM's prefix cache of ``blocks`` blocks of ``BS`` tokens, with KV events on."""

    def __init__(self, blocks: int) -> None:
        import torch
        from vllm.utils.hashing import sha256_cbor
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

        init_none_hash(sha256_cbor)
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32)
        config = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
        self.cache = KVCacheManager(
            config,
            max_model_len=4096,
            scheduler_block_size=BS,
            hash_block_size=BS,
            enable_caching=True,
            enable_kv_cache_events=True,
        )
        self.hasher = get_request_block_hasher(BS, sha256_cbor)
        self.n = 0

    def request(self, tokens: list[int], **extra: Any) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        self.n += 1
        params = SamplingParams(max_tokens=1, extra_args=extra or None)
        return Request(str(self.n), tokens, params, None, block_hasher=self.hasher)

    def run(self, tokens: list[int], **extra: Any) -> tuple[Any, int]:
        """Schedule a prefill of ``tokens``; returns the request and the blocks found cached.
        ``extra``: the request's ``vllm_xargs``."""
        r = self.request(tokens, **extra)
        blocks, cached, _ = self.cache.get_computed_blocks(r)
        assert self.cache.allocate_slots(r, r.num_tokens - cached, cached, blocks) is not None
        return r, cached // BS

    def cached(self, tokens: list[int]) -> int:
        """How many blocks of ``tokens`` the engine would serve from its cache now."""
        return int(self.cache.get_computed_blocks(self.request(tokens))[1]) // BS

    def batch(self) -> bytes:
        """This step's events, as the engine's publisher encodes them."""
        from vllm.distributed.kv_events import KVEventBatch

        return msgspec.msgpack.Encoder().encode(KVEventBatch(ts=0.0, events=self.cache.take_events()))


def _apply(ledger: BlockLedger, payload: bytes) -> dict[str, Any]:
    return ledger.apply(e for e in msgspec.msgpack.decode(payload)[1] if isinstance(e, dict))


def test_a_block_evicted_and_stored_again_in_one_step_stays_in_the_index() -> None:
    """One step evicts a prefix's blocks (the LRU frees a request's blocks tail first) and a
    request with that prefix computes them again: the line is the batch's net change, so the
    gateway, which applies add before del, keeps them."""
    engine, ledger, index = Engine(blocks=12), BlockLedger(), KVIndex()
    prefix = list(range(100, 116))  # 4 blocks
    keys = block_keys(prefix, BS)
    first, _ = engine.run(prefix + [1])
    engine.cache.free(first)
    index.apply("m", "r1", **_kw(_apply(ledger, engine.batch())))
    other, _ = engine.run(list(range(500, 532)))  # takes the free blocks and prefix's first
    engine.cache.free(other)
    again, hit = engine.run(prefix + [2])
    assert hit == 3  # the engine recomputes the evicted block: removed and stored in one batch
    line = _apply(ledger, engine.batch())
    assert not set(line["add"]) & set(line["del"])
    index.apply("m", "r1", **_kw(line))
    assert index.matched("m", "r1", keys) == 4 and index.blocks_held("m", "r1") == len(ledger.held)
    assert engine.cached(prefix + [3]) == 4


def _kw(line: dict[str, Any]) -> dict[str, Any]:
    return {"added": line["add"], "removed": line["del"]}


def test_the_same_engine_hash_stored_twice_is_held_until_its_last_block_goes() -> None:
    """Two requests with the same 4 full blocks: the second recomputes the last one, so the
    engine holds two blocks with one hash, and evicts them one at a time."""
    engine, ledger = Engine(blocks=12), BlockLedger()
    prompt = list(range(100, 116))
    keys = block_keys(prompt, BS)
    a, _ = engine.run(prompt)
    assert _apply(ledger, engine.batch())["add"] == keys
    b, hit = engine.run(prompt)
    assert hit == 3 and _apply(ledger, engine.batch()) == {"add": [], "del": []}  # a second copy
    engine.cache.free(a)
    engine.cache.free(b)
    engine.run(list(range(500, 528)))  # pushes one copy of the last block out
    line = _apply(ledger, engine.batch())
    assert keys[3] not in line["del"] and set(keys) <= set(ledger.held)
    assert engine.cached(prompt + [1]) == 4  # the engine still serves all four

    synthetic = BlockLedger()  # the same in plain events: a second block 7 after 6, removed once per copy
    first = {"type": "BlockStored", "block_hashes": [6, 7], "parent_block_hash": None, "token_ids": [1] * 2 * BS}
    first |= {"block_size": BS, "lora_name": None}
    synthetic.apply([first, first | {"block_hashes": [7], "parent_block_hash": 6, "token_ids": [1] * BS}])
    removed = {"type": "BlockRemoved", "block_hashes": [7]}
    assert synthetic.apply([removed]) == {"add": [], "del": []}
    assert synthetic.apply([removed]) == {"add": [], "del": block_keys([1] * 2 * BS, BS)[1:]}


def test_a_prefix_reported_again_is_not_counted_as_a_second_copy() -> None:
    """``vllm_xargs: {"kv_cache_report_mode": "full"}`` (any client may send it) makes vLLM publish
    a request's cache hits as stores, with no block behind them: counted as copies, they would
    keep the keys after the engine evicted the blocks."""
    engine, ledger = Engine(blocks=12), BlockLedger()
    prefix = list(range(100, 116))
    keys = block_keys(prefix, BS)
    first, _ = engine.run(prefix + [1])
    engine.cache.free(first)
    _apply(ledger, engine.batch())
    for _ in range(3):
        again, hit = engine.run(prefix + [2], kv_cache_report_mode="full")
        engine.cache.free(again)
        assert hit == 4
        report = msgspec.msgpack.decode(engine.batch())[1]
        assert report[0]["type"] == "BlockStored" and report[0]["parent_block_hash"] is None
        assert ledger.apply(e for e in report if isinstance(e, dict)) == {"add": [], "del": []}
    engine.run(list(range(500, 544)))  # takes every block: evicts the prefix
    line = _apply(ledger, engine.batch())
    assert set(keys) <= set(line["del"]) and not set(keys) & set(ledger.held)


async def test_a_stream_whose_reader_stops_reading_is_cut_off(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A gateway that stops reading its stream (paused, wedged) must not make the replica buffer
    every later batch for it: past ``STREAM_LINES`` queued the stream ends, without a traceback."""
    monkeypatch.setattr(kv_events, "STREAM_LINES", 16)
    relay = KVEventRelay("tok", "/nowhere")
    port = free_port()
    await relay.start("127.0.0.1", port)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(b"GET /kv/blocks HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer tok\r\n\r\n")  # then never reads
    warned: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
    kv_events.logger.addHandler(handler)
    try:
        await _until(lambda: len(relay._streams) == 1)
        with caplog.at_level(logging.ERROR, logger="aiohttp.server"):
            for i in range(2000):
                relay._emit({"add": list(range(i * 64, i * 64 + 64)), "del": []})
                if i % 100 == 0:
                    await asyncio.sleep(0)
            await _until(lambda: not relay._streams)
            await asyncio.sleep(0.2)
        assert any("fell 16 lines behind" in w for w in warned)
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # no handler traceback
    finally:
        kv_events.logger.removeHandler(handler)
        s.close()
        await relay.stop()


async def test_a_gateway_cut_off_reconnects_and_starts_again_from_the_whole_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kv_index, "RETRY_S", 0.05)
    relay = KVEventRelay("tok", "/nowhere")
    url = await relay.start("127.0.0.1", free_port())
    feeds = KVFeeds()
    keys = block_keys(list(range(8)), BS)
    try:
        feeds.sync([Record("m--v1", "r1", "http://engine", "tok", 1, events=url)])
        await _until(lambda: len(relay._streams) == 1)
        stored = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None}
        relay.ledger.apply([stored | {"token_ids": list(range(8)), "block_size": BS, "lora_name": None}])
        (stream,) = relay._streams  # the change never reached the stream: only the snapshot has it
        relay._streams.discard(stream)
        stream.end()
        await _until(lambda: feeds.index.matched("m--v1", "r1", keys) == 2)
    finally:
        feeds.stop()
        await relay.stop()


def _batch(*events: Any) -> bytes:
    from vllm.distributed.kv_events import KVEventBatch

    return msgspec.msgpack.Encoder().encode(KVEventBatch(ts=0.0, events=list(events)))


def _stored(h: int, token: int) -> Any:
    from vllm.distributed.kv_events import BlockStored

    return BlockStored(
        block_hashes=[h],
        parent_block_hash=None,
        token_ids=[token] * BS,
        block_size=BS,
        lora_id=None,
        medium="CPU",
        lora_name=None,
    )


def _removed(h: int) -> Any:
    from vllm.distributed.kv_events import BlockRemoved

    return BlockRemoved(block_hashes=[h], medium="CPU")


def _relay_holding_x() -> tuple[KVEventRelay, _Stream]:
    """A relay that applied batch 0 (block X stored), with an open stream that keeps up."""
    relay = KVEventRelay("tok", "/nowhere")
    relay._batch(0, _batch(_stored(99, 9)))
    stream = _Stream(None)
    stream.queue = asyncio.Queue()  # unbounded: whatever the test sends
    relay._streams.add(stream)
    return relay, stream


X = block_keys([9] * BS, BS)[0]


class Replay:
    """The engine's replay socket (a ROUTER, as vLLM's publisher binds it), answering each
    request with the batches ``answer`` gives for its start, then the end marker."""

    def __init__(self, endpoint: str, answer: Any) -> None:
        import zmq
        import zmq.asyncio

        self.sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self.sock.bind(endpoint)
        self.answer = answer
        self.task = asyncio.ensure_future(self._serve())

    async def _serve(self) -> None:
        while True:
            client, _, start = await self.sock.recv_multipart()
            batches = self.answer(int.from_bytes(start, "big"))
            if batches is None:
                continue  # no answer at all
            for seq, payload in batches:
                await self.sock.send_multipart((client, b"", b"kv", seq.to_bytes(8, "big"), payload))
            await self.sock.send_multipart((client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""))

    def close(self) -> None:
        self.task.cancel()
        self.sock.close(linger=0)


BATCHES = {1: _batch(_stored(1, 1)), 2: _batch(_removed(99)), 3: _batch(_stored(3, 3)), 4: _batch(_stored(4, 4))}


@pytest.mark.parametrize(
    ("answer", "complete"),
    [
        ([1, 2, 3], True),
        ([1, 3], False),  # a hole: batch 2 (X removed) dropped on the way
        ([2, 3], False),  # the buffer no longer holds the first batch asked for
        ([1], False),  # the buffer ended before the live batch
        (None, False),  # no answer
    ],
)
async def test_a_gap_not_filled_from_the_replay_clears_the_ledger_and_the_gateways(
    monkeypatch: pytest.MonkeyPatch, answer: list[int] | None, complete: bool
) -> None:
    """Batches 1..3 were missed (zmq dropped them), batch 4 came: what the replay socket cannot
    give back in full, in order, leaves the ledger and the gateways' index empty (a ``reset``
    line with no key): under-reporting, never a block the engine evicted (X)."""
    import zmq.asyncio

    monkeypatch.setattr(kv_events, "REPLAY_WAIT_S", 0.3)
    relay, stream = _relay_holding_x()
    replay = Replay(relay.replay, lambda start: None if answer is None else [(s, BATCHES[s]) for s in answer])
    try:
        await relay._receive(zmq.asyncio.Context.instance(), 4, BATCHES[4])
    finally:
        replay.close()
        relay.close_sync()
    assert relay._seq == 4
    lines = []
    while not stream.queue.empty():
        lines.append(stream.queue.get_nowait())
    four = block_keys([4] * BS, BS)[0]
    if complete:
        assert set(relay.ledger.held) == {four, *block_keys([1] * BS, BS), *block_keys([3] * BS, BS)}
        assert all(b'"reset"' not in line for line in lines)
    else:
        assert relay.ledger.held == [four] and X not in relay.ledger.held
        resets = [json.loads(line) for line in lines if b'"reset": true' in line]
        assert resets == [{"block_size": BS, "add": [], "del": [], "reset": True}]
        index = KVIndex()  # a gateway's, applying the lines as KVFeeds does
        index.reset("m", "r1", BS, [X])
        for line in lines:
            decoded = json.loads(line)
            if decoded.get("reset"):
                index.reset("m", "r1", BS, decoded["add"])
            else:
                index.apply("m", "r1", decoded["add"], decoded["del"])
        assert index.matched("m", "r1", [X]) == 0 and index.matched("m", "r1", [four]) == 1


async def test_vllms_replay_socket_fills_a_long_gap_or_the_index_is_cleared() -> None:
    """vLLM's publisher replays up to 10,000 batches through a ROUTER that drops what is above its
    high-water mark (1,000) while the reader's side is full: with the relay's raised to 100,000,
    5,000 lost batches come back in full on an idle machine. Whatever is dropped on a busy one,
    the block evicted near the end of the gap (X) is never left in the ledger."""
    import zmq.asyncio
    from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

    relay, stream = _relay_holding_x()
    pub = ZmqEventPublisher(0, endpoint=relay.endpoint, replay_endpoint=relay.replay, topic="kv")
    n = 5000
    try:
        for i in range(n):
            pub.publish(KVEventBatch(ts=0.0, events=[_removed(99)] if i == n - 10 else [_stored(1000 + i, 100 + i)]))
        await _until(lambda: pub._event_queue.qsize() == 0)
        await asyncio.sleep(0.3)
        await relay._receive(zmq.asyncio.Context.instance(), n, _batch(_stored(1000 + n, 100 + n)))
    finally:
        pub.shutdown()
        relay.close_sync()
    assert relay._seq == n and X not in relay.ledger.held
    lines = [stream.queue.get_nowait() for _ in range(stream.queue.qsize())]
    if any(b'"reset": true' in line for line in lines):  # batches dropped on the way: cleared
        assert relay.ledger.held == block_keys([100 + n] * BS, BS)
    else:
        assert len(relay.ledger.held) == n - 1  # batches 1..n-1 (one removed X) and the live one


async def _until(cond: Any, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)
