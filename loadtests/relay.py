"""Relay benchmark: the gateway's own CPU cost per streamed request, with no engine in the way.

    python -m loadtests.relay [--requests 1000] [--concurrency 8] [--chunks 64] [--repeats 3] \
        [--code DIR] [--max-migrations N]

Starts two processes: a synthetic model replica (an asyncio HTTP server that answers every
completion with ``--chunks`` SSE events 1 ms apart, a usage event and ``[DONE]``, shaped as vLLM
0.32 shapes them for that request: token ids with ``return_token_ids``, running usage on every
chunk with ``continuous_usage_stats``, both of which the gateway asks for)
and one gateway: this repository's gateway app (``serving.gateway.api.create_api`` over
``GatewayCore``) on its own listener (uvicorn, as in a gateway replica), with the replica as its
only upstream and auth off. Closed-loop streaming clients (``loadtests.client``) then send
``--requests`` requests, ``--repeats`` times, and the script prints the gateway process's CPU per
request. ``--chunks 1`` isolates the per-request part; the rest divided by the chunks is the cost of
relaying one chunk.

``--max-migrations 0`` turns the gateway's stream migration off (it then asks for no token ids).
``--code DIR`` runs the gateway from another checkout (``DIR/serving``), e.g. an older commit
from ``git worktree add``, for a before/after on the same machine. Figures: docs/performance.md,
"The relay".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from importlib import import_module
from pathlib import Path
from typing import Any

__all__ = ["FixedLease", "OneReplica", "main"]


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def replica(port: int, chunks: int) -> None:
    """The synthetic replica: raw HTTP/1.1 keep-alive, chunked SSE like vLLM's."""
    import uvloop

    prompt_ids = list(range(100, 116))  # 16 prompt tokens

    def event(i: int, ids: bool, usage: bool) -> bytes:
        """Chunk ``i`` as vLLM 0.32 sends it: token ids with ``return_token_ids`` (the prompt's in
        the first chunk), else nulls; the running usage with ``continuous_usage_stats``."""
        choice = {"index": 0, "text": f" tok{i}", "logprobs": None, "finish_reason": None, "stop_reason": None}
        choice |= {"prompt_token_ids": (prompt_ids if i == 0 else None) if ids else None}
        choice |= {"token_ids": [200 + i] if ids else None}
        body = {
            "id": "cmpl-0123456789abcdef0123456789abcdef",
            "object": "text_completion",
            "created": 1,
            "model": "m",
            "choices": [choice],
            "usage": {"prompt_tokens": 16, "total_tokens": 17 + i, "completion_tokens": i + 1} if usage else None,
        }
        return _chunk(b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n")

    streams = {
        (ids, usage): [event(i, ids, usage) for i in range(chunks)] for ids in (False, True) for usage in (False, True)
    }
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":16,"completion_tokens":%d,"total_tokens":%d}}\n\n' % (
        chunks,
        chunks + 16,
    )
    tail = _chunk(usage) + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n"

    class Conn(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport, self.buf = transport, b""

        def data_received(self, data: bytes) -> None:
            self.buf += data
            while (end := self.buf.find(b"\r\n\r\n")) >= 0:
                headers = self.buf[:end].lower()
                at = headers.find(b"content-length:")
                size = int(headers[at + 15 :].split(b"\r\n")[0]) if at >= 0 else 0
                if len(self.buf) < end + 4 + size:
                    return
                body = json.loads(self.buf[end + 4 : end + 4 + size] or b"{}")
                self.buf = self.buf[end + 4 + size :]
                ids = bool(body.get("return_token_ids"))
                usage = bool((body.get("stream_options") or {}).get("continuous_usage_stats"))
                asyncio.ensure_future(self.answer(streams[ids, usage]))

        async def answer(self, events: list[bytes]) -> None:
            self.transport.write(head)  # type: ignore[attr-defined]
            for ev in events:
                await asyncio.sleep(0.001)
                self.transport.write(ev)  # type: ignore[attr-defined]
            self.transport.write(tail)  # type: ignore[attr-defined]

    async def serve() -> None:
        server = await asyncio.get_running_loop().create_server(Conn, "127.0.0.1", port, backlog=1024)
        await server.serve_forever()

    uvloop.run(serve())


class FixedLease:
    """A lease on the one upstream replica (the gateway's ``Lease`` protocol, no Ray)."""

    route, replica, token = "direct", "r1", "t"

    def __init__(self, url: str, released: list[bool]) -> None:
        self.url, self._released = url, released
        self.died = asyncio.Event()

    def release(self, failed: bool = False) -> None:
        self._released.append(failed)


class OneReplica:
    """A lease provider that always hands out ``url``; ``released`` records each release."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.released: list[bool] = []

    async def lease(
        self, app: str, hint: object, timeout_s: float, limit: int = 0, loaded_first: bool = True
    ) -> FixedLease:
        return FixedLease(self.url, self.released)

    async def ready(self, app: str, timeout_s: float) -> bool:
        return True


def _core(leases: OneReplica, max_migrations: int | None = None) -> Any:
    """A gateway core with one open model ``m``: today's config types, or a checkout's older ones;
    ``max_migrations``: that gateway field, else its default."""
    from serving.gateway import core

    stack = {"auth": {"mode": "open"}, "models": [{"name": "m", "versions": [{"version": "v1"}]}]}
    try:
        from serving.config import GatewayConfig, parse_config
        from serving.control.serve_config import routing_user_config

        fields = {} if max_migrations is None else {"max_migrations": max_migrations}
        gateway = core.GatewayCore(GatewayConfig(**fields), leases)
        gateway.reconfigure(routing_user_config(parse_config(stack)))
    except ImportError:  # a checkout from before the typed user_config
        gateway = core.GatewayCore(getattr(core, "GatewaySettings")(), leases)  # noqa: B009 - gone from today's core
        model = {"name": "m", "max_model_len": 1024, "versions": [{"version": "v1", "weight": 100, "app": "m"}]}
        gateway.reconfigure({"auth": {"mode": "open"}, "models": [model]})
    return gateway


def gateway(port: int, upstream: str, max_migrations: int | None = None) -> None:
    """This checkout's gateway app (or ``--code``'s) with one fixed upstream replica."""
    import uvloop

    try:
        Listener = import_module("serving.gateway.listener").Listener
    except ImportError:  # a checkout from before the gateway's modules were named for what they do
        Listener = import_module("serving.gateway.direct").DirectListener
    try:
        create_api = import_module("serving.gateway.api").create_api
    except ImportError:  # a checkout whose app is assembled in serving.gateway.routes
        create_api = import_module("serving.gateway.routes").create_api

    async def serve() -> None:
        leases = OneReplica(upstream)
        core = _core(leases, max_migrations)
        await Listener(create_api(core), "127.0.0.1", port).start()
        await asyncio.Event().wait()

    uvloop.run(serve())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.relay", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--chunks", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--code", type=Path, default=None, help="checkout whose serving/ the gateway runs")
    p.add_argument("--max-migrations", type=int, default=None, help="the gateway's max_migrations (default: its own)")
    p.add_argument("--role", choices=["replica", "gateway"], help=argparse.SUPPRESS)
    p.add_argument("--ports", type=int, nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    here = Path(__file__).resolve().parent
    code = (args.code or here.parent).resolve()
    if args.role:  # a child, run as a script: import serving from ``code`` only
        sys.path[:] = [str(code)] + [d for d in sys.path if d and Path(d).resolve() != here]
        replica_port, gateway_port = args.ports
        if args.role == "replica":
            replica(replica_port, args.chunks)
        else:
            gateway(gateway_port, f"http://127.0.0.1:{replica_port}", args.max_migrations)
        return 0

    from loadtests.client import run_level
    from loadtests.cpuprof import cpu_seconds
    from loadtests.servers import wait_serving
    from serving.replica.node import free_port

    replica_port, gateway_port = free_port(), free_port()
    me = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--chunks",
        str(args.chunks),
        "--code",
        str(code),
        "--ports",
        str(replica_port),
        str(gateway_port),
        *(["--max-migrations", str(args.max_migrations)] if args.max_migrations is not None else []),
        "--role",
    ]
    procs = [subprocess.Popen([*me, "replica"]), subprocess.Popen([*me, "gateway"])]
    try:
        gw = procs[1].pid
        url = f"http://127.0.0.1:{gateway_port}"
        wait_serving(url, None, "m", 120, procs[1])  # both up: a request went through the gateway

        def body() -> dict[str, object]:
            return {"model": "m", "prompt": "hello", "max_tokens": args.chunks, "stream": True}

        asyncio.run(run_level(url, None, "/v1/completions", body, args.concurrency, min(200, args.requests)))
        mig = "" if args.max_migrations is None else f", max_migrations {args.max_migrations}"
        print(f"gateway code: {code}; {args.chunks} chunks per request, {args.concurrency} clients{mig}")
        for _ in range(args.repeats):
            cpu0, t0 = cpu_seconds(gw), time.monotonic()
            r = asyncio.run(run_level(url, None, "/v1/completions", body, args.concurrency, args.requests))
            wall, cpu = time.monotonic() - t0, cpu_seconds(gw) - cpu0
            served = r.requests_per_s * wall
            per_req = cpu / served * 1e3 if served else float("nan")
            print(
                f"  {r.requests_per_s:7.1f} req/s  failures {r.failures}  gateway {cpu / wall:.2f} cores  "
                f"{per_req:.2f} ms CPU/request  TTFT p50 {r.ttft_p50_ms:.1f} ms",
                flush=True,
            )
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
