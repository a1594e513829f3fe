"""The gateway replicas' own listener (``gateway.ingress: listener``): shared port, request counting,
draining, and how the stack config turns into it. Runs real uvicorn servers on loopback."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from serving.config import ConfigError, ShutdownConfig, parse_config
from serving.control.serve_config import build_serve_config
from serving.gateway.listener import Listener, bind_shared
from serving.replica.node import free_port

MODEL = {"name": "adder", "versions": [{"version": "v1"}]}


def _app(name: str, gate: asyncio.Event | None = None) -> FastAPI:
    app = FastAPI()

    @app.get("/who")
    async def who() -> dict[str, str]:
        if gate is not None:
            await gate.wait()
        return {"name": name}

    return app


async def test_two_listeners_share_one_port_and_both_serve() -> None:
    port = free_port()
    a, b = Listener(_app("a"), "127.0.0.1", port), Listener(_app("b"), "127.0.0.1", port)
    await a.start()
    await b.start()
    try:
        seen: set[str] = set()
        for _ in range(200):  # a new connection each time: the kernel spreads them over both
            async with httpx.AsyncClient() as c:
                seen.add((await c.get(f"http://127.0.0.1:{port}/who")).json()["name"])
            if seen == {"a", "b"}:
                break
        assert seen == {"a", "b"}
        await a.stop()  # one replica leaves: the other alone answers, nothing is refused
        for _ in range(20):
            async with httpx.AsyncClient() as c:
                assert (await c.get(f"http://127.0.0.1:{port}/who")).json()["name"] == "b"
    finally:
        await a.stop()
        await b.stop()


async def test_in_flight_counts_requests_and_stop_lets_them_finish() -> None:
    gate = asyncio.Event()
    port = free_port()
    lis = Listener(_app("a", gate), "127.0.0.1", port, drain_s=10)
    await lis.start()
    async with httpx.AsyncClient(timeout=20) as c:
        calls = [asyncio.ensure_future(c.get(f"http://127.0.0.1:{port}/who")) for _ in range(3)]
        for _ in range(100):
            if lis.in_flight == 3:
                break
            await asyncio.sleep(0.02)
        assert lis.in_flight == 3
        stopping = asyncio.ensure_future(lis.stop())
        await asyncio.sleep(0.2)
        assert not stopping.done()  # draining: the three are still running
        with pytest.raises(httpx.ConnectError):  # and no new connection is accepted
            await c.get(f"http://127.0.0.1:{port}/who", headers={"connection": "close"})
        gate.set()
        assert [r.json() for r in await asyncio.gather(*calls)] == [{"name": "a"}] * 3
        await stopping
    assert lis.in_flight == 0


def test_a_port_held_without_reuseport_is_an_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(OSError):
            bind_shared("127.0.0.1", s.getsockname()[1])


def test_autoscaling_key_exists_in_this_ray() -> None:
    """The gateway reports its listener's requests under the key Serve's default policy reads."""
    from ray.serve._private.common import RUNNING_REQUESTS_KEY

    from serving.gateway import deployment

    assert deployment.RUNNING_REQUESTS_KEY == RUNNING_REQUESTS_KEY == "running_requests"


def test_direct_ingress_is_the_default_and_moves_serves_proxy_aside() -> None:
    sc = build_serve_config(parse_config({"auth": {"mode": "open"}, "models": [MODEL], "gateway": {"port": 9100}}))
    gateway = sc["applications"][0]["args"]["config"]
    assert (gateway["ingress"], gateway["host"], gateway["port"]) == ("listener", "127.0.0.1", 9100)
    limits = ("keep_alive_s", "header_timeout_s", "body_timeout_s", "max_client_connections")
    assert [gateway[k] for k in limits] == [60, 10.0, 30.0, 4096]
    assert sc["applications"][0]["args"]["shutdown"] == {"grace_s": 60, "notice_s": 5}
    assert sc["http_options"]["port"] == 9101
    sc = build_serve_config(
        parse_config({"auth": {"mode": "open"}, "models": [MODEL], "gateway": {"port": 9100, "proxy_port": 9200}})
    )
    assert sc["http_options"]["port"] == 9200


def test_serve_proxy_ingress_keeps_the_port_on_serves_proxy() -> None:
    sc = build_serve_config(
        parse_config({"auth": {"mode": "open"}, "models": [MODEL], "gateway": {"port": 9100, "ingress": "serve_proxy"}})
    )
    assert sc["applications"][0]["args"]["config"]["ingress"] == "serve_proxy"
    assert sc["http_options"]["port"] == 9100


def test_proxy_port_equal_to_port_is_refused() -> None:
    with pytest.raises(ConfigError, match="proxy_port must differ"):
        parse_config({"auth": {"mode": "open"}, "models": [MODEL], "gateway": {"port": 9100, "proxy_port": 9100}})


def test_a_restarted_gateway_replica_starts_before_the_old_one_stops() -> None:
    sc = build_serve_config(parse_config({"auth": {"mode": "open"}, "models": [MODEL]}))
    assert sc["applications"][0]["deployments"][0]["max_surge_percent"] == 100


def test_a_stack_does_not_start_on_a_port_someone_listens_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway binds with SO_REUSEPORT, which would not fail on a taken port by itself."""
    from serving.config import LocalRayConfig
    from serving.control import stack

    monkeypatch.setattr(stack, "RUN_DIR", tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"port\\(s\\) \\[{port}\\]"):
            stack.start_ray("porttest", LocalRayConfig(), {}, "http://x", (port, free_port()))
    assert not list(tmp_path.iterdir())  # nothing was started or recorded


async def test_a_cold_model_that_does_not_start_in_time_is_a_503_with_retry_after() -> None:
    """ReplicaFinder waits for a replica (scale from zero) at most the model's cold_start_timeout_s,
    then withdraws the queued lease call and answers 503 with Retry-After. Only Serve's handle is
    replaced here; the cold start itself is tests/e2e/test_scaling.py."""
    from serving.contract import LeaseHint
    from serving.errors import Unavailable
    from serving.gateway.replicas import ReplicaFinder

    cancelled: list[bool] = []

    class NeverStarts:  # a lease call queued in Serve's router while no replica exists
        async def __anext__(self) -> object:
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

        def cancel(self) -> None:
            cancelled.append(True)

    class Handle:
        class lease:  # noqa: N801 - mirrors handle.lease.remote(...)
            @staticmethod
            def remote(hint: LeaseHint) -> NeverStarts:
                return NeverStarts()

    leases = ReplicaFinder()
    leases._handles["cold--v1"] = Handle()  # type: ignore[assignment]
    with pytest.raises(Unavailable) as err:
        await leases.lease("cold--v1", LeaseHint(), timeout_s=0.3)
    assert err.value.status == 503 and err.value.headers == {"retry-after": "5"}
    assert "No replica of 'cold--v1' became available in 0s" in str(err.value)
    assert cancelled == [True]
    # a client that leaves while it waits withdraws the call too: a replica granted later would
    # otherwise hold that lease (one of its max_ongoing_requests) for good
    waiting = asyncio.ensure_future(leases.lease("cold--v1", LeaseHint(), timeout_s=30))
    await asyncio.sleep(0.1)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert cancelled == [True, True]


async def test_a_stopping_listener_fails_readiness_first_then_drains_then_closes() -> None:
    """The order a load balancer needs: readiness fails while the listener still serves (and asks
    clients to reconnect elsewhere), then it stops accepting, finishes what runs, and closes."""
    gate = asyncio.Event()
    app = _app("a", gate)

    @app.get("/-/healthz")
    async def healthz() -> str:
        return "success"

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    lis = Listener(app, "127.0.0.1", port, drain_s=10, notice_s=1.0)
    await lis.start()
    async with httpx.AsyncClient(timeout=20) as c:
        assert (await c.get(f"{url}/-/healthz")).status_code == 200
        running = asyncio.ensure_future(c.get(f"{url}/who"))
        for _ in range(100):
            if lis.in_flight == 1:
                break
            await asyncio.sleep(0.02)
        stopping = asyncio.ensure_future(lis.stop())
        await asyncio.sleep(0.2)
        # 1. readiness fails at once, but the listener still accepts and serves
        ready = await c.get(f"{url}/-/healthz")
        assert ready.status_code == 503 and ready.headers["connection"] == "close"
        gate.set()
        answered = await running
        assert answered.json() == {"name": "a"} and answered.headers["connection"] == "close"
        gate.clear()
        late = asyncio.ensure_future(c.get(f"{url}/who"))  # arrives during the notice period
        await asyncio.sleep(1.2)  # 2. the notice is over: no new connection is accepted
        with pytest.raises(httpx.ConnectError):
            await c.get(f"{url}/who", headers={"connection": "close"})
        assert not stopping.done()  # 3. the request in progress still runs
        gate.set()
        assert (await late).json() == {"name": "a"}
        await stopping  # 4. closed
    assert lis.in_flight == 0


def test_one_shutdown_budget_for_every_deployment() -> None:
    cfg = parse_config({"auth": {"mode": "open"}, "models": [MODEL], "shutdown": {"grace_s": 45, "notice_s": 4}})
    sc = build_serve_config(cfg)
    gateway, model, _controller = sc["applications"]
    assert [d["graceful_shutdown_timeout_s"] for a in sc["applications"] for d in a["deployments"]] == [45, 45, 45]
    shutdown = ShutdownConfig.model_validate(gateway["args"]["shutdown"])
    assert shutdown.notice_s == 4 and shutdown.notice_s + shutdown.listener_drain_s < 45
    assert model["args"]["spec"]["shutdown_grace_s"] == 45
    with pytest.raises(ConfigError, match="grace_s must exceed notice_s"):
        parse_config({"auth": {"mode": "open"}, "models": [MODEL], "shutdown": {"grace_s": 20, "notice_s": 15}})
