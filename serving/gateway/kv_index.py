"""KV-aware routing (``router: kv_aware``): which replica's engine holds which prompt blocks.

Each model replica streams the keys of the blocks its engine holds in its prefix cache
(:mod:`serving.replica.kv_events`: vLLM's KV events, turned into :func:`serving.contract.block_keys`
on the replica's node). :class:`KVFeeds` keeps one stream open per replica whose record offers
one, feeding :class:`KVIndex`; a replica whose record disappears (drained, dead, restarted)
leaves the index with its stream. A new gateway replica gets each engine's whole state as the
first line of each stream, so every gateway's index converges on what the engines report; a
``reset`` line replaces what the index held for that replica (with no key after the replica lost
events), and a stream that ends (the replica cut off a reader that fell behind) is reopened.

Per request the gateway tokenizes the prompt with the model's own tokenizer and chat template
(fetched once per app from a replica, :class:`Prompts`; chat rendered as vLLM renders it,
:mod:`serving.gateway.kv_chat`), computes the block keys, and
:meth:`serving.gateway.replicas.EndpointTable.pick` chooses the replica with the best
``matched blocks - LOAD_BLOCKS x in-flight requests`` (ties: fewer in flight, then fewer blocks
held, so new prefixes spread over the caches). A block this gateway has just routed
counts as held on that replica for ``PENDING_S``, until the engine's own event arrives, so a burst
of one new prefix is not spread over every replica before the first prefill ends.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from serving.contract import BlockKey, Record, block_keys
from serving.gateway.kv_chat import Unrenderable, chat_tokens

logger = logging.getLogger("serving.gateway")

__all__ = ["LOAD_BLOCKS", "PENDING_S", "KVFeeds", "KVIndex", "Prompts"]

PENDING_S = 5.0  # a block routed here counts as held this long before the engine reports it
LOAD_BLOCKS = 1.0  # one request in flight weighs as much as one cached block
RETRY_S = 1.0  # a broken stream is reopened after this
TOKENIZER_RETRY_S = 30.0


class KVIndex:
    """Per app and replica: the block keys the engine reported, and the ones routed there lately."""

    def __init__(self, pending_s: float = PENDING_S) -> None:
        self.pending_s = pending_s
        self._held: dict[str, dict[str, set[BlockKey]]] = {}
        self._pending: dict[str, dict[str, dict[BlockKey, float]]] = {}
        self.block_size: dict[str, int] = {}

    def reset(self, app: str, replica: str, block_size: int, keys: Iterable[BlockKey]) -> None:
        if block_size:
            self.block_size[app] = block_size
        self._held.setdefault(app, {})[replica] = set(keys)

    def apply(self, app: str, replica: str, added: Iterable[BlockKey], removed: Iterable[BlockKey]) -> None:
        held = self._held.setdefault(app, {}).setdefault(replica, set())
        held.update(added)
        held.difference_update(removed)

    def drop(self, app: str, replica: str) -> None:
        self._held.get(app, {}).pop(replica, None)
        self._pending.get(app, {}).pop(replica, None)

    def routed(self, app: str, replica: str, keys: Sequence[BlockKey], now: float | None = None) -> None:
        if not keys:
            return
        until = (time.monotonic() if now is None else now) + self.pending_s
        pending = self._pending.setdefault(app, {}).setdefault(replica, {})
        if len(pending) > 4096:  # lazily forget the expired ones
            cut = until - self.pending_s
            for k in [k for k, t in pending.items() if t <= cut]:
                del pending[k]
        for k in keys:
            pending[k] = until

    def matched(self, app: str, replica: str, keys: Sequence[BlockKey], now: float | None = None) -> int:
        """How many leading blocks of ``keys`` the replica holds (or was sent lately)."""
        held = self._held.get(app, {}).get(replica, set())
        pending = self._pending.get(app, {}).get(replica, {})
        now = time.monotonic() if now is None else now
        n = 0
        for k in keys:
            if k not in held and pending.get(k, 0.0) <= now:
                break
            n += 1
        return n

    def blocks_held(self, app: str, replica: str) -> int:
        return len(self._held.get(app, {}).get(replica, ()))


class Prompts:
    """A model's tokenizer and chat template, as its engine applies them, to key a request's blocks."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def from_files(cls, files: dict[str, str]) -> Prompts:
        from transformers import AutoTokenizer

        with tempfile.TemporaryDirectory(prefix="raystack-tok-") as d:
            for name, data in files.items():
                (Path(d) / Path(name).name).write_bytes(base64.b64decode(data))
            return cls(AutoTokenizer.from_pretrained(d))

    def tokens(self, kind: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids for a chat or completion body (None: another kind, or unreadable)."""
        tok = self.tokenizer
        if kind == "completion":
            p = body.get("prompt")
            p = p[0] if isinstance(p, list) and p and not isinstance(p[0], int) else p
            if isinstance(p, list) and all(isinstance(t, int) for t in p):
                return list(p)
            return list(tok(p)["input_ids"]) if isinstance(p, str) else None
        if kind not in ("chat", "messages"):
            return None
        try:
            return chat_tokens(tok, kind, body)
        except Unrenderable:
            return None


class KVFeeds:
    """One gateway replica's KV-block streams (one per model replica that offers one) and the
    tokenizers of the apps they serve."""

    def __init__(self, index: KVIndex | None = None) -> None:
        self.index = index or KVIndex()
        self._streams: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._prompts: dict[str, Prompts] = {}
        self._loading: dict[str, asyncio.Task[None]] = {}
        self._retry_at: dict[str, float] = {}  # an app whose tokenizer could not be loaded: when to try again
        self._session: Any = None

    def keys(self, app: str, kind: str, body: dict[str, Any], adapter: str | None) -> tuple[BlockKey, ...] | None:
        """The request's block keys, or None when the app's tokenizer or block size is not known yet."""
        prompts, size = self._prompts.get(app), self.index.block_size.get(app)
        if prompts is None or not size:
            return None
        try:
            tokens = prompts.tokens(kind, body)
            salt = body.get("cache_salt")
            return tuple(block_keys(tokens, size, adapter, salt if isinstance(salt, str) else None)) if tokens else None
        except Exception:  # noqa: BLE001 - the engine will say what is wrong with it; route by load
            return None

    def sync(self, records: Iterable[Record]) -> None:
        """Follow the streams of these (live) records; forget the replicas not among them."""
        want = {(r.app, r.replica): r for r in records if r.events}
        for key in [k for k in self._streams if k not in want]:
            self._streams.pop(key).cancel()
            self.index.drop(*key)
        loop = asyncio.get_running_loop()
        for key, record in want.items():
            if key not in self._streams:
                self._streams[key] = loop.create_task(self._follow(record))
            app = record.app
            if app not in self._prompts and app not in self._loading and time.monotonic() >= self._retry_at.get(app, 0):
                self._loading[app] = loop.create_task(self._load_prompts(record))

    def stop(self) -> None:
        for task in [*self._streams.values(), *self._loading.values()]:
            task.cancel()
        if self._session is not None:
            asyncio.ensure_future(self._session.close())
            self._session = None

    def _client(self) -> Any:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=5), read_bufsize=1 << 20
            )
        return self._session

    async def _load_prompts(self, record: Record) -> None:
        try:
            async with self._client().get(
                f"{record.events}/kv/tokenizer", headers={"authorization": f"Bearer {record.token}"}
            ) as resp:
                resp.raise_for_status()
                files = (await resp.json())["files"]
            self._prompts[record.app] = await asyncio.to_thread(Prompts.from_files, files)
            logger.info("kv_aware: tokenizer of %s loaded", record.app)
        except Exception as exc:  # noqa: BLE001 - routed by load until a retry succeeds
            self._retry_at[record.app] = time.monotonic() + TOKENIZER_RETRY_S
            logger.warning(
                "kv_aware: cannot load the tokenizer of %s (retried in %.0fs): %s", record.app, TOKENIZER_RETRY_S, exc
            )
        finally:
            self._loading.pop(record.app, None)

    async def _follow(self, record: Record) -> None:
        app, replica = record.app, record.replica
        while True:
            try:
                async with self._client().get(
                    f"{record.events}/kv/blocks", headers={"authorization": f"Bearer {record.token}"}
                ) as resp:
                    resp.raise_for_status()
                    async for raw in resp.content:
                        line = json.loads(raw)
                        if line.get("reset"):
                            self.index.reset(app, replica, int(line.get("block_size") or 0), line.get("add", ()))
                        else:
                            if line.get("block_size"):
                                self.index.block_size[app] = int(line["block_size"])
                            self.index.apply(app, replica, line.get("add", ()), line.get("del", ()))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - reopened while the record lives
                logger.warning("kv_aware: the block stream of %s broke: %s", replica, exc)
            self.index.drop(app, replica)
            await asyncio.sleep(RETRY_S)
