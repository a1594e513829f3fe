"""The replica's KV-block stream, for ``router: kv_aware`` (:mod:`serving.gateway.kv_index`).

vLLM publishes a batch of KV cache events per engine step when it is started with
``--kv-events-config`` (:func:`kv_events_config`): blocks stored (their engine hashes, parent
hash, token ids and LoRA adapter), blocks removed (engine hashes) and all blocks cleared. Its
publisher binds wherever it is told without authentication, and the events carry the prompt's
tokens, so here it binds an ``ipc://`` socket in a directory only this user can enter, and
nothing but this replica, on the same node, reads it.

:class:`BlockLedger` turns the events into the contract's block keys
(:func:`serving.contract.chain_key`: a hash chain over each block's tokens and adapter, which the
gateway computes the same way from a request's tokens), so no token or text leaves the node.
:class:`KVEventRelay` subscribes to the engine's socket and serves, on the node's address behind
the replica's token:

- ``GET /kv/blocks``: a newline-delimited JSON stream: first the block size and every key the
  engine holds now (``{"block_size": 128, "reset": true, "add": [...]}``), then one line per event
  batch (``{"add": [...], "del": [...]}``; ``reset`` when the engine cleared its cache). A gateway
  that connects late (a new gateway replica) gets the whole state first, so every gateway's index
  converges on what the engine reports.
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
from collections.abc import Hashable, Iterable
from pathlib import Path
from typing import Any

from serving.contract import BlockKey, chain_key

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


class BlockLedger:
    """Which blocks an engine holds, as contract keys, from its KV events.

    A stored block's key chains on its parent's key, so a store whose parent was never seen
    (an event lost before this ledger started) cannot be keyed; its blocks are skipped, and the
    gateway simply finds no match for them."""

    def __init__(self) -> None:
        self.block_size = 0
        self._keys: dict[Hashable, BlockKey] = {}  # engine block hash -> contract key
        self._held: dict[BlockKey, int] = {}  # key -> engine blocks with it (an adapter's and a base's differ)
        self.unkeyed = 0  # stored blocks skipped for an unknown parent

    @property
    def held(self) -> list[BlockKey]:
        return list(self._held)

    def apply(self, events: Iterable[dict[str, Any]]) -> dict[str, Any]:
        """Apply one batch of decoded events; returns the change as a stream line."""
        added: list[BlockKey] = []
        removed: list[BlockKey] = []
        reset = False
        for ev in events:
            kind = ev.get("type")
            if kind == "BlockStored":
                added += self._stored(ev)
            elif kind == "BlockRemoved":
                for h in ev.get("block_hashes") or ():
                    key = self._keys.pop(_hashable(h), None)
                    if key is not None and self._drop(key):
                        removed.append(key)
            elif kind == "AllBlocksCleared":
                self._keys.clear()
                self._held.clear()
                added, removed, reset = [], [], True
        line: dict[str, Any] = {"add": added, "del": removed}
        if reset:
            line["reset"] = True
        return line

    def _stored(self, ev: dict[str, Any]) -> list[BlockKey]:
        size = int(ev.get("block_size") or 0)
        hashes = [_hashable(h) for h in ev.get("block_hashes") or ()]
        tokens = list(ev.get("token_ids") or ())
        if not size or len(tokens) < size * len(hashes):
            return []
        self.block_size = size
        parent_hash = ev.get("parent_block_hash")
        parent: BlockKey | None = None
        if parent_hash is not None:
            parent = self._keys.get(_hashable(parent_hash))
            if parent is None:
                self.unkeyed += len(hashes)
                return []
        adapter = ev.get("lora_name")
        # a sequence's first block carries the request's cache_salt among its extra keys
        salt = _salt((ev.get("extra_keys") or [None])[0], adapter) if parent_hash is None else None
        added = []
        for i, h in enumerate(hashes):
            parent = chain_key(parent, adapter, tokens[i * size : (i + 1) * size], salt if i == 0 else None)
            if h in self._keys:
                continue
            self._keys[h] = parent
            self._held[parent] = self._held.get(parent, 0) + 1
            if self._held[parent] == 1:
                added.append(parent)
        return added

    def _drop(self, key: BlockKey) -> bool:
        n = self._held.get(key, 0) - 1
        if n > 0:
            self._held[key] = n
            return False
        self._held.pop(key, None)
        return True


def _salt(extra: Any, adapter: str | None) -> str | None:
    """The ``cache_salt`` among a block's extra keys as vLLM publishes them: the adapter's name
    first (when it has one), then multimodal ``[id, offset]`` pairs, the salt, prompt-embedding
    digests (bytes)."""
    items = list(extra) if isinstance(extra, (list, tuple)) else []
    if adapter and items and items[0] == adapter:
        items = items[1:]
    return next((k for k in items if isinstance(k, str)), None)


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


def _hashable(h: Any) -> Hashable:
    return bytes(h) if isinstance(h, (bytes, bytearray, memoryview)) else h


def tokenizer_files(model_dir: str | Path) -> dict[str, str]:
    """The version's tokenizer files (names in :data:`TOKENIZER_FILES`), base64."""
    out = {}
    for path in Path(model_dir).iterdir():
        if path.name in TOKENIZER_FILES and path.is_file():
            out[path.name] = base64.b64encode(path.read_bytes()).decode()
    return out


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
        self._streams: set[asyncio.Queue[bytes]] = set()
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
        for queue in self._streams:
            queue.put_nowait(b"")  # ends each open stream, so the server stops at once
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
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        self._streams.add(queue)
        try:
            await resp.write(_lines(self.ledger.block_size, self.ledger.held, [], reset=True))
            while data := await queue.get():  # b"": the relay stops
                await resp.write(data)
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self._streams.discard(queue)
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
        for queue in self._streams:
            queue.put_nowait(data)

    def _batch(self, seq: int, payload: bytes) -> None:
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
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(self.endpoint)
        try:
            while True:
                _topic, seq_bytes, payload = await sub.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big")
                if self._seq >= 0 and seq > self._seq + 1:
                    await self._replay_from(ctx, self._seq + 1, seq)
                try:
                    self._batch(seq, payload)
                except Exception:  # noqa: BLE001 - one unreadable batch must not end the stream
                    logger.exception("unreadable KV event batch %d", seq)
        finally:
            sub.close(linger=0)

    async def _replay_from(self, ctx: Any, start: int, until: int) -> None:
        """Batches ``start`` .. ``until - 1`` were lost (zmq drops above its high-water mark): ask
        the engine's replay buffer for them."""
        import zmq

        logger.warning("KV events %d..%d missed; replaying", start, until - 1)
        req = ctx.socket(zmq.DEALER)
        req.connect(self.replay)
        try:
            await req.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                if not await req.poll(REPLAY_WAIT_S * 1000):
                    logger.warning("KV event replay timed out")
                    return
                _empty, _topic, seq_bytes, payload = await req.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq < 0 or seq >= until:
                    return
                self._batch(seq, payload)
        finally:
            req.close(linger=0)


def private_dir_ok(path: str) -> bool:
    """The sockets' directory is reachable by its owner only."""
    return os.stat(path).st_mode & 0o077 == 0
