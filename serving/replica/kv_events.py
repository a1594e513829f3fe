"""The replica's KV-block stream, for ``router: kv_aware`` (:mod:`serving.gateway.kv_index`).

vLLM publishes a batch of KV cache events per engine step when it is started with
``--kv-events-config`` (:func:`kv_events_config`): blocks stored (their engine hashes, parent
hash, token ids and LoRA adapter), blocks removed (engine hashes) and all blocks cleared. Its
publisher binds wherever it is told without authentication, and the events carry the prompt's
tokens, so here it binds an ``ipc://`` socket in a directory only this user can enter, and
nothing but this replica, on the same node, reads it.

:class:`BlockLedger` (:mod:`serving.replica.kv_ledger`) turns the events into the contract's block
keys (:func:`serving.contract.chain_key`: a hash chain over each block's tokens and adapter, which
the gateway computes the same way from a request's tokens), so no token or text leaves the node.
:class:`KVEventRelay` subscribes to the engine's socket and serves, on the node's address behind
the replica's token:

- ``GET /kv/blocks``: a newline-delimited JSON stream: first the block size and every key the
  engine holds now (``{"block_size": 128, "reset": true, "add": [...]}``), then one line per event
  batch, its net change (``{"add": [...], "del": [...]}``; ``reset`` when the engine cleared its
  cache). A gateway that connects late (a new gateway replica) gets the whole state first, so every
  gateway's index converges on what the engine reports. Batches the subscriber missed are asked
  of the engine's replay socket; when they cannot all be had in order, the ledger is cleared and
  the stream sends a ``reset`` with no key (the gateways under-report, never keep an evicted
  block). A stream whose reader falls ``STREAM_LINES`` behind is cut off; it reconnects and starts
  again from the whole state.
- ``GET /kv/tokenizer``: the tokenizer files of the version (already verified against the
  manifest in the node cache), base64 in JSON, so the gateway tokenizes prompts as the engine does.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from serving.contract import BlockKey
from serving.replica.kv_ledger import BlockLedger

logger = logging.getLogger("ray.serve")

__all__ = ["TOKENIZER_FILES", "BlockLedger", "KVEventRelay", "kv_events_config"]

# What a Hugging Face tokenizer (and its chat template) is loaded from; never the weights.
TOKENIZER_FILES = frozenset(
    {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "chat_template.jinja",
        "chat_template.json",
        "vocab.json",
        "vocab.txt",
        "merges.txt",
        "tokenizer.model",
        "config.json",
        "generation_config.json",
    }
)
REPLAY_WAIT_S = 2.0
LINE_KEYS = 2048  # keys per line of the stream (about 40 KB)
STREAM_LINES = 4096  # lines queued for one gateway's stream before it is cut off
RECEIVE_HWM = 100_000  # messages zmq queues for the subscriber (vLLM's publisher: 100,000 to send)


def kv_events_config(endpoint: str, replay: str) -> str:
    """vLLM's ``--kv-events-config``: the zmq publisher on ``endpoint`` (an ``ipc://`` path), its
    replay socket on ``replay``."""
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": endpoint,
            "replay_endpoint": replay,
            "topic": "kv",
        }
    )


def _lines(block_size: int, added: list[BlockKey], removed: list[BlockKey], reset: bool = False) -> bytes:
    """Stream lines of at most ``LINE_KEYS`` keys each (a reader buffers a line whole); ``reset``
    on the first: what follows replaces what the reader held."""
    out = b""
    for at in range(0, max(len(added), len(removed), 1), LINE_KEYS):
        line: dict[str, Any] = {"block_size": block_size, "add": added[at : at + LINE_KEYS]}
        line["del"] = removed[at : at + LINE_KEYS]
        if reset and at == 0:
            line["reset"] = True
        out += json.dumps(line).encode() + b"\n"
    return out


def tokenizer_files(model_dir: str | Path) -> dict[str, str]:
    """The version's tokenizer files (names in :data:`TOKENIZER_FILES`), base64."""
    out = {}
    for path in Path(model_dir).iterdir():
        if path.name in TOKENIZER_FILES and path.is_file():
            out[path.name] = base64.b64encode(path.read_bytes()).decode()
    return out


class _Stream:
    """One gateway's open ``/kv/blocks`` stream: the lines waiting for it, at most
    ``STREAM_LINES``."""

    __slots__ = ("queue", "transport")

    def __init__(self, transport: Any) -> None:
        self.queue: asyncio.Queue[bytes] = asyncio.Queue(maxsize=STREAM_LINES)
        self.transport = transport

    def end(self) -> None:
        """End the stream now: what it still had queued is dropped and the connection is cut, so
        a reader that stopped reading costs nothing more; it reconnects and starts again from the
        whole state."""
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queue.put_nowait(b"")
        if self.transport is not None:
            self.transport.abort()


class KVEventRelay:
    """Subscribes to one engine's KV events (``ipc://`` in a private directory) and streams them
    as block keys to gateways, behind the replica's token."""

    def __init__(self, token: str, model_dir: str) -> None:
        self._token = token
        self._model_dir = model_dir
        self.dir = tempfile.mkdtemp(prefix="raystack-kv-")  # mode 0700: only this user reaches the sockets
        self.endpoint = f"ipc://{self.dir}/events"
        self.replay = f"ipc://{self.dir}/replay"
        self.ledger = BlockLedger()
        self._streams: set[_Stream] = set()
        self._seq = -1
        self._tasks: list[asyncio.Task[None]] = []
        self._runner: Any = None
        self.url = ""

    @property
    def config(self) -> str:
        return kv_events_config(self.endpoint, self.replay)

    async def start(self, host: str, port: int) -> str:
        """Subscribe to the engine and serve the stream on ``host:port``; returns its URL."""
        from aiohttp import web

        app = web.Application()
        app.router.add_get("/kv/blocks", self._blocks)
        app.router.add_get("/kv/tokenizer", self._tokenizer)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        self._tasks.append(asyncio.get_running_loop().create_task(self._subscribe()))
        self.url = f"http://{host}:{port}"
        return self.url

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for stream in self._streams:  # ends each open stream, so the server stops at once
            if stream.queue.full():
                stream.end()
            else:
                stream.queue.put_nowait(b"")
        if self._runner is not None:
            await self._runner.cleanup()
        shutil.rmtree(self.dir, ignore_errors=True)

    def close_sync(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def _authorized(self, request: Any) -> bool:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.encode(), self._token.encode())

    async def _blocks(self, request: Any) -> Any:
        from aiohttp import web

        if not self._authorized(request):
            return web.json_response({"error": {"message": "Missing or wrong replica token."}}, status=401)
        resp = web.StreamResponse(headers={"content-type": "application/x-ndjson"})
        await resp.prepare(request)
        stream = _Stream(request.transport)
        self._streams.add(stream)
        try:
            await resp.write(_lines(self.ledger.block_size, self.ledger.held, [], reset=True))
            while data := await stream.queue.get():  # b"": the relay stops, or the reader fell behind
                await resp.write(data)
        except (ConnectionError, asyncio.CancelledError):  # the reader went away (or was cut off)
            pass
        finally:
            self._streams.discard(stream)
        return resp

    async def _tokenizer(self, request: Any) -> Any:
        from aiohttp import web

        if not self._authorized(request):
            return web.json_response({"error": {"message": "Missing or wrong replica token."}}, status=401)
        files = await asyncio.to_thread(tokenizer_files, self._model_dir)
        return web.json_response({"files": files})

    def _emit(self, line: dict[str, Any]) -> None:
        if not (line["add"] or line["del"] or line.get("reset")):
            return
        data = _lines(self.ledger.block_size, line["add"], line["del"], reset=bool(line.get("reset")))
        for stream in list(self._streams):
            try:
                stream.queue.put_nowait(data)
            except asyncio.QueueFull:  # its reader stopped reading: cut it off rather than buffer
                logger.warning("a KV block stream fell %d lines behind; ended (its reader reconnects)", STREAM_LINES)
                self._streams.discard(stream)
                stream.end()

    def _lost(self, why: str) -> None:
        """Events were lost: the ledger starts again empty, and so does every gateway's index of
        this replica (a ``reset`` line with no key), so they under-report, never hold phantoms."""
        logger.warning("KV events lost (%s): block ledger cleared", why)
        self.ledger.clear()
        self._emit({"add": [], "del": [], "reset": True})

    def _batch(self, seq: int, payload: bytes) -> None:
        """Apply batch ``seq`` (one already applied is skipped); raises if it cannot be read."""
        import msgspec

        if seq <= self._seq:
            return  # already applied (a replayed batch)
        self._seq = seq
        batch = msgspec.msgpack.decode(payload)
        events = batch[1] if isinstance(batch, list) and len(batch) > 1 else []
        self._emit(self.ledger.apply(e for e in events if isinstance(e, dict)))

    async def _subscribe(self) -> None:
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(self.endpoint)
        try:
            while True:
                _topic, seq_bytes, payload = await sub.recv_multipart()
                await self._receive(ctx, int.from_bytes(seq_bytes, "big"), payload)
        finally:
            sub.close(linger=0)

    async def _receive(self, ctx: Any, seq: int, payload: bytes) -> None:
        """A batch from the engine's publisher: the ones missed before it first (replayed, or the
        ledger is cleared if they cannot all be had), then it."""
        if self._seq >= 0 and seq > self._seq + 1 and not await self._replay_from(ctx, self._seq + 1, seq):
            self._lost(f"batches {self._seq + 1}..{seq - 1} could not be replayed")
            self._seq = seq - 1
        try:
            self._batch(seq, payload)
        except Exception:  # noqa: BLE001 - one unreadable batch must not end the stream
            logger.exception("unreadable KV event batch %d", seq)
            self._lost(f"batch {seq} unreadable")

    async def _replay_from(self, ctx: Any, start: int, until: int) -> bool:
        """Batches ``start`` .. ``until - 1`` were lost (zmq drops above its high-water mark): ask
        the engine's replay buffer for them. True once each was applied, in order; False on a
        hole (one the buffer no longer holds, or one zmq dropped on the way), an unreadable batch,
        or no answer within ``REPLAY_WAIT_S``."""
        import zmq

        logger.warning("KV events %d..%d missed; replaying", start, until - 1)
        req = ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        req.connect(self.replay)
        expected = start
        try:
            await req.send_multipart((b"", start.to_bytes(8, "big")))
            while expected < until:
                if not await req.poll(REPLAY_WAIT_S * 1000):
                    logger.warning("KV event replay timed out at batch %d", expected)
                    return False
                _empty, _topic, seq_bytes, payload = await req.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq != expected:  # -1: the buffer ended first; above: batches in between missing
                    logger.warning("KV event replay: batch %d expected, %d came", expected, seq)
                    return False
                self._batch(seq, payload)
                expected = seq + 1
            return True
        except Exception:  # noqa: BLE001 - an unreadable batch: the ledger is cleared instead
            logger.exception("unreadable KV event batch %d in the replay", expected)
            return False
        finally:
            req.close(linger=0)


def private_dir_ok(path: str) -> bool:
    """The sockets' directory is reachable by its owner only."""
    return os.stat(path).st_mode & 0o077 == 0
