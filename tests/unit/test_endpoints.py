"""Direct replica routing: the endpoint records, the gateway's table and its fallbacks to Serve."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Callable

import pytest

from serving.contract import LeaseHint, Record, publish, read_records, withdraw
from serving.gateway.replicas import EndpointTable
from serving.replica.node import free_port
from tests.support.kv import MemoryKV
from tests.support.loopback import http_replica


class PassThrough:
    """An Observer that passes chunks through and records how requests finished."""

    def __init__(self) -> None:
        self.finished: list[int] = []

    def feed(self, chunk: bytes) -> bytes:
        return chunk

    held_error = False

    def flush(self) -> bytes:
        return b""

    def failed(self, request_id: str) -> bytes:
        from serving.errors import UpstreamError, sse_error_event

        return sse_error_event(UpstreamError("The model replica failed while streaming."), request_id)

    def retried(self) -> None:
        pass

    def finish(self, status: int, body: bytes | None = None) -> None:
        self.finished.append(status)


def _picked(table: EndpointTable, app: str) -> set[str]:
    """The replicas the table picks for ``app`` (each pick released again)."""
    out = set()
    for _ in range(10):
        lease = table.pick(app)
        if lease is not None:
            out.add(lease.replica)
            lease.release()
    return out


def _rec(app: str, replica: str, seq: int = 1, state: str = "up") -> Record:
    return Record(app, replica, f"http://10.0.0.1:{9000 + len(replica)}", "tok-" + replica, seq, state)


def _reads(
    table: EndpointTable,
    records: list[Record] | Callable[[float], list[Record]],
    start: float,
    end: float,
    step: float = 1.0,
) -> list[str]:
    """Read the store every ``step`` seconds from ``start`` to ``end`` (``records``: a list, or a
    function of the time); returns the replicas reported dead on the way."""
    dead, now = [], start
    while now <= end:
        dead += table.update(records(now) if callable(records) else records, now=now)
        now += step
    return dead


def test_records_round_trip_and_withdraw() -> None:
    kv = MemoryKV()
    publish(kv, "adder--v1", "r1", "http://10.0.0.1:9001", "t1", seq=5)
    publish(kv, "adder--v1", "r2", "http://10.0.0.2:9002", "t2", seq=6, state="hung")
    publish(kv, "sub--v1", "r3", "http://10.0.0.3:9003", "t3", seq=7)
    kv.put("ep/broken/r9", b"not json")  # a bad record is skipped, not fatal
    recs = sorted(read_records(kv), key=lambda r: r.replica)
    assert [(r.app, r.replica, r.url, r.token, r.seq, r.state) for r in recs] == [
        ("adder--v1", "r1", "http://10.0.0.1:9001", "t1", 5, "up"),
        ("adder--v1", "r2", "http://10.0.0.2:9002", "t2", 6, "hung"),
        ("sub--v1", "r3", "http://10.0.0.3:9003", "t3", 7, "up"),
    ]
    withdraw(kv, "adder--v1", "r1")
    assert {r.replica for r in read_records(kv)} == {"r2", "r3"}


def test_power_of_two_by_own_in_flight_and_release() -> None:
    table = EndpointTable(rng=random.Random(0))
    table.update([_rec("a", "r1"), _rec("a", "r2"), _rec("b", "r3")], now=1000.0)
    assert table.pick("missing") is None  # unknown app: the caller leases through Serve
    held = [table.pick("a") for _ in range(10)]
    counts = Counter(lease.replica for lease in held if lease)
    assert counts == {"r1": 5, "r2": 5}  # two replicas: the less busy one each time
    for lease in held:
        assert lease is not None
        lease.release()
        lease.release()  # idempotent
    assert table.in_flight("r1") == table.in_flight("r2") == 0
    only = table.pick("b")
    assert only is not None and (only.url, only.token) == ("http://10.0.0.1:9002", "tok-r3")


def test_limit_hands_the_request_to_serve() -> None:
    table = EndpointTable(rng=random.Random(1))
    table.update([_rec("a", "r1")], now=1000.0)
    first, second = table.pick("a", limit=2), table.pick("a", limit=2)
    assert first and second
    assert table.pick("a", limit=2) is None  # at max_ongoing_requests: Serve's router queues it
    first.release()
    assert table.pick("a", limit=2) is not None


def test_a_failed_replica_is_skipped_for_a_while() -> None:
    table = EndpointTable(failed_s=5.0, rng=random.Random(2))
    table.update([_rec("a", "r1"), _rec("a", "r2")], now=1000.0)
    lease = table.pick("a")
    assert lease is not None
    bad = lease.replica
    lease.release(failed=True)
    assert {table.pick("a").replica for _ in range(20)} == {"r1", "r2"} - {bad}  # type: ignore[union-attr]


def test_stale_heartbeat_drops_the_replica_and_tells_its_streams() -> None:
    table = EndpointTable(stale_s=10.0, rng=random.Random(3))
    table.update([_rec("a", "r1"), _rec("a", "r2")], now=1001.0)
    leases = [table.pick("a") for _ in range(4)]
    on_r1 = [lease for lease in leases if lease and lease.replica == "r1"]
    on_r2 = [lease for lease in leases if lease and lease.replica == "r2"]
    assert on_r1 and on_r2
    # r1 stopped heartbeating (its node died); r2 withdrew its record (it drains)
    assert _reads(table, [_rec("a", "r1")], 1002.0, 1011.0) == []  # unchanged for 10 s: not yet
    assert not any(lease.died.is_set() for lease in on_r1)
    assert table.update([_rec("a", "r1")], now=1012.0) == ["r1"]
    assert all(lease.died.is_set() for lease in on_r1)
    assert not any(lease.died.is_set() for lease in on_r2)  # a draining replica finishes its streams
    assert table.pick("a") is None
    assert table.update([_rec("a", "r1")], now=1013.0) == []  # reported once


def test_a_record_that_keeps_changing_is_live_whatever_its_sequence() -> None:
    """Only a change counts: no clock of the replica's node is compared with the gateway's."""
    table = EndpointTable(stale_s=10.0)
    beats = lambda now: [_rec("a", "r1", seq=int(now) // 2 * 7919 % 1000)]  # noqa: E731 - any value, changing
    assert _reads(table, beats, 0.0, 100.0) == []
    assert _picked(table, "a") == {"r1"}


def test_a_store_pause_declares_nothing_stale_until_a_full_period_of_good_reads() -> None:
    """The GCS paused for 20 s: the read in progress returns after the pause with records that
    have not changed since before it. That read, and the next ``stale_s`` of reads, drop nobody."""
    table = EndpointTable(stale_s=10.0)
    assert _reads(table, [_rec("a", "r1", seq=1)], 0.0, 5.0) == []
    lease = table.pick("a")
    assert lease is not None
    # no read completes from 5 s to 25 s; then the records are as they were
    assert _reads(table, [_rec("a", "r1", seq=1)], 25.0, 35.0) == []
    assert not lease.died.is_set() and _picked(table, "a") == {"r1"}
    # the replica's heartbeats resume: it stays
    assert _reads(table, lambda now: [_rec("a", "r1", seq=int(now) // 2)], 36.0, 80.0) == []
    # a replica that really died is dropped once the store was readable for a full period
    assert _reads(table, [_rec("a", "r1", seq=999)], 81.0, 91.0) == []
    assert table.update([_rec("a", "r1", seq=999)], now=92.0) == ["r1"]
    assert lease.died.is_set()


def test_a_failed_read_restarts_the_period() -> None:
    table = EndpointTable(stale_s=10.0, max_gap_s=100.0)  # reads are frequent: only failures count
    assert _reads(table, [_rec("a", "r1")], 0.0, 8.0) == []
    table.read_failed()
    assert _reads(table, [_rec("a", "r1")], 9.0, 19.0) == []  # quiet 18 s, but readable only 10 s
    assert table.update([_rec("a", "r1")], now=20.0) == ["r1"]


def test_a_hung_replica_is_dead_at_once() -> None:
    """Its record says ``hung``: its requests are told ``died`` (those without a first byte are
    retried on another replica) and it is not picked again."""
    table = EndpointTable(rng=random.Random(5))
    table.update([_rec("a", "r1"), _rec("a", "r2")], now=0.0)
    leases = [table.pick("a") for _ in range(6)]
    assert table.update([_rec("a", "r1", seq=2, state="hung"), _rec("a", "r2", seq=2)], now=1.0) == ["r1"]
    assert all(lease.died.is_set() == (lease.replica == "r1") for lease in leases if lease)
    assert {table.pick("a").replica for _ in range(10)} == {"r2"}  # type: ignore[union-attr]


def test_records_unchanged_for_the_purge_period_expire() -> None:
    from serving.gateway import replicas as endpoints

    table = EndpointTable()
    records = lambda now: [_rec("a", "killed"), _rec("a", "live", seq=int(now))]  # noqa: E731
    _reads(table, records, 0.0, endpoints.PURGE_S)
    assert table.expired(now=endpoints.PURGE_S) == []
    _reads(table, records, endpoints.PURGE_S + 1, endpoints.PURGE_S + 2)
    assert table.expired(now=endpoints.PURGE_S + 2) == [("a", "killed")]


async def test_gateways_delete_the_records_that_expired() -> None:
    import time

    from serving.gateway import replicas as endpoints

    kv = MemoryKV()
    publish(kv, "a", "killed", "http://x:1", "t", seq=1)
    publish(kv, "a", "live", "http://x:3", "t", seq=1)
    table = EndpointTable()
    start = time.monotonic() - endpoints.PURGE_S - 2  # this gateway has read the store for a minute

    def records(now: float) -> list[Record]:
        publish(kv, "a", "live", "http://x:3", "t", seq=int(now))
        return read_records(kv)

    _reads(table, records, start, time.monotonic())
    task = asyncio.ensure_future(table.refresh_forever(kv, period_s=0.01))
    try:
        for _ in range(100):
            if "ep/a/killed" not in kv.data:
                break
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
    assert sorted(kv.data) == ["ep/a/live"]
    picked = table.pick("a")
    assert picked is not None and picked.replica == "live"


async def test_serve_leases_pick_directly_and_fall_back_to_serve() -> None:
    """No Ray call when a replica is known; Serve's handle for hints, unknown apps and full replicas."""
    from serving.gateway.replicas import ReplicaFinder

    calls: list[str] = []

    class Gen:
        def __init__(self, app: str) -> None:
            self.app = app

        async def __anext__(self) -> object:
            from serving.contract import Endpoint

            return Endpoint("http://serve-picked:1", "tok", f"serve-{self.app}")

        def cancel(self) -> None:
            pass

    def handle(app: str) -> object:
        class H:
            class lease:  # noqa: N801 - mirrors handle.lease.remote(...)
                @staticmethod
                def remote(hint: LeaseHint) -> Gen:
                    calls.append(app)
                    return Gen(app)

        return H()

    kv = MemoryKV()
    publish(kv, "a--v1", "r1", "http://10.0.0.1:9001", "t1", seq=1)
    leases = ReplicaFinder(direct=True, kv=kv)
    leases._handles = {"a--v1": handle("a--v1"), "cold--v1": handle("cold--v1")}  # type: ignore[dict-item]
    leases.start()
    try:
        for _ in range(50):
            if leases.table and leases.table.loaded:
                break
            await asyncio.sleep(0.05)
        direct = await leases.lease("a--v1", LeaseHint(), 5.0, limit=1)
        assert direct.replica == "r1" and calls == []
        full = await leases.lease("a--v1", LeaseHint(), 5.0, limit=1)  # r1 is at its limit
        assert full.replica == "serve-a--v1" and calls == ["a--v1"]
        hinted = await leases.lease("a--v1", LeaseHint(session_id="s1"), 5.0)  # affinity: Serve's router
        cold = await leases.lease("cold--v1", LeaseHint(), 5.0)  # no endpoint yet: Serve scales it up
        assert (hinted.replica, cold.replica) == ("serve-a--v1", "serve-cold--v1")
        assert calls == ["a--v1", "a--v1", "cold--v1"]
        for lease in (direct, full, hinted, cold):
            lease.release()
    finally:
        leases.stop()
    assert ReplicaFinder(direct=False).table is None  # replica_routing: serve


@pytest.mark.parametrize("failed", [True, False])
async def test_forward_marks_a_replica_that_failed_before_the_first_byte(failed: bool) -> None:
    """A refused connection is retried on another replica, and the failed one is not picked again
    for a while; a replica that answered keeps its place."""
    from aiohttp import web

    from serving.gateway.relay import Upstream, forward

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"choices": [{"text": "1"}]})

    async with http_replica(ok) as good, http_replica(ok) as other:
        bad = f"http://127.0.0.1:{free_port()}" if failed else other  # nothing listens: refused
        table = EndpointTable(rng=random.Random(4))
        table.update([Record("a", "bad", bad, "t", 1), Record("a", "good", good, "t", 1)])
        tried: list[str] = []

        async def leaser():  # noqa: ANN202
            lease = table.pick("a")
            assert lease is not None
            tried.append(lease.replica)
            return lease

        client = Upstream(16, 10.0)
        try:
            for _ in range(6):
                result = await forward(
                    client=client,
                    leaser=leaser,
                    path="/v1/completions",
                    body=b"{}",
                    stream=False,
                    request_id="r",
                    retries=2,
                    obs=PassThrough(),
                )
                assert result.status == 200 and result.body == b'{"choices": [{"text": "1"}]}'
        finally:
            await client.aclose()
    down = [r for r in tried if r == "bad"]
    if failed:
        assert len(down) == 1 and len(tried) == 7  # one refusal, retried; then never picked again
    else:
        assert 0 < len(down) < 6 and len(tried) == 6  # both serve
    assert table.in_flight("good") == table.in_flight("bad") == 0


async def test_a_stream_from_a_replica_whose_heartbeat_stopped_ends_with_an_error_event() -> None:
    """The replica's node is gone: its socket never closes, but the stale heartbeat sets ``died``
    and the client gets the tokens so far plus an SSE error event instead of a hang."""
    from aiohttp import web

    from serving.gateway.relay import Upstream, forward

    release = asyncio.Event()

    async def one_token_then_silence(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": "4"}]}\n\n')
        await release.wait()
        return resp

    async with http_replica(one_token_then_silence) as url:
        table = EndpointTable(stale_s=10.0)
        table.update([Record("a", "r1", url, "t", 1)], now=1001.0)

        async def leaser():  # noqa: ANN202
            return table.pick("a")

        obs = PassThrough()
        client = Upstream(16, 600.0)
        try:
            result = await forward(
                client=client,
                leaser=leaser,
                path="/v1/completions",
                body=b"{}",
                stream=True,
                request_id="req-1",
                retries=0,
                obs=obs,
            )
            assert result.stream is not None and result.route == "direct"
            out: list[bytes] = []

            async def read() -> None:
                async for chunk in result.stream:  # type: ignore[union-attr]
                    out.append(chunk)

            reader = asyncio.ensure_future(read())
            await asyncio.sleep(0.2)
            assert out == [b'data: {"choices": [{"text": "4"}]}\n\n'] and not reader.done()
            _reads(table, [Record("a", "r1", url, "t", 1)], 1002.0, 1012.0)  # no heartbeat for 11 s
            await asyncio.wait_for(reader, 5)
        finally:
            release.set()
            await client.aclose()
    text = b"".join(out).decode()
    assert '"error"' in text and "req-1" in text and text.rstrip().endswith("data: [DONE]")
    assert obs.finished == [502] and table.in_flight("r1") == 0
