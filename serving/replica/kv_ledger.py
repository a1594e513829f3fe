"""Which blocks one engine holds, as the contract's block keys, from its KV events
(:mod:`serving.replica.kv_events` relays them to the gateways).

A stored block's key is :func:`serving.contract.chain_key` over its tokens, its adapter and its
parent's key (the hash chain the gateway computes from a request's tokens), so no token or text
leaves the node. vLLM publishes one event per physical block: the same engine hash may be stored
twice (a request that recomputed the last block of a cached prompt) and each copy is removed on
its own, so each engine hash is counted, and a key leaves the ledger only with its last block.
A store from a sequence's first block (no parent) of hashes already held is not counted: vLLM
publishes a request's prefix-cache hits that way too (``kv_cache_report_mode: full`` in the
request's ``vllm_xargs``), with no block behind them and no removal to follow.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

from serving.contract import BlockKey, chain_key

__all__ = ["BlockLedger"]


class BlockLedger:
    """Which blocks an engine holds, as contract keys, from its KV events.

    A stored block's key chains on its parent's key, so a store whose parent was never seen
    (an event lost before this ledger started, or before it was cleared) cannot be keyed; its
    blocks are skipped, and the gateway simply finds no match for them."""

    def __init__(self) -> None:
        self.block_size = 0
        self._keys: dict[Hashable, BlockKey] = {}  # engine block hash -> contract key
        self._copies: dict[Hashable, int] = {}  # engine block hash -> engine blocks stored with it
        self._held: dict[BlockKey, int] = {}  # key -> engine blocks with it (an adapter's and a base's differ)
        self.unkeyed = 0  # stored blocks skipped for an unknown parent

    @property
    def held(self) -> list[BlockKey]:
        return list(self._held)

    def clear(self) -> None:
        """Forget every block (the engine cleared its cache, or events were lost)."""
        self._keys.clear()
        self._copies.clear()
        self._held.clear()

    def apply(self, events: Iterable[dict[str, Any]]) -> dict[str, Any]:
        """Apply one batch of decoded events; returns its net change as a stream line: the keys
        held after the batch and not before (``add``), and the reverse (``del``), so a block
        evicted and stored again within one batch is in neither. After ``AllBlocksCleared`` the
        line is a ``reset`` carrying every key held at the end of the batch."""
        before: dict[BlockKey, bool] = {}  # each key the batch touched: held before it?
        reset = False
        for ev in events:
            kind = ev.get("type")
            if kind == "BlockStored":
                self._stored(ev, before)
            elif kind == "BlockRemoved":
                for h in ev.get("block_hashes") or ():
                    self._removed(_hashable(h), before)
            elif kind == "AllBlocksCleared":
                self.clear()
                reset = True
        if reset:
            return {"add": self.held, "del": [], "reset": True}
        return {
            "add": [k for k, was in before.items() if not was and k in self._held],
            "del": [k for k, was in before.items() if was and k not in self._held],
        }

    def _stored(self, ev: dict[str, Any], before: dict[BlockKey, bool]) -> None:
        size = int(ev.get("block_size") or 0)
        hashes = [_hashable(h) for h in ev.get("block_hashes") or ()]
        tokens = list(ev.get("token_ids") or ())
        if not size or len(tokens) < size * len(hashes):
            return
        self.block_size = size
        parent_hash = ev.get("parent_block_hash")
        parent: BlockKey | None = None
        if parent_hash is not None:
            parent = self._keys.get(_hashable(parent_hash))
            if parent is None:
                self.unkeyed += len(hashes)
                return
        adapter = ev.get("lora_name")
        # a sequence's first block carries the request's cache_salt among its extra keys
        salt = _salt((ev.get("extra_keys") or [None])[0], adapter) if parent_hash is None else None
        for i, h in enumerate(hashes):
            known = self._keys.get(h)
            if known is not None and parent_hash is None:
                # a prefix vLLM reports again (``kv_cache_report_mode: full``: its cache hits,
                # published like stores, from the first block), or one recomputed from the first
                # block (prompt logprobs): not counted again, so the key goes with its first
                # copy at worst, never stays after the engine's last
                parent = known
                continue
            if known is None:
                known = chain_key(parent, adapter, tokens[i * size : (i + 1) * size], salt if i == 0 else None)
            parent = known
            before.setdefault(parent, parent in self._held)
            self._keys[h] = parent
            self._copies[h] = self._copies.get(h, 0) + 1  # more than 1: a block computed again
            self._held[parent] = self._held.get(parent, 0) + 1

    def _removed(self, h: Hashable, before: dict[BlockKey, bool]) -> None:
        key = self._keys.get(h)
        if key is None:
            return  # never keyed (its parent was unknown), or already gone
        before.setdefault(key, key in self._held)
        copies = self._copies.get(h, 1) - 1
        if copies > 0:
            self._copies[h] = copies
        else:
            self._copies.pop(h, None)
            del self._keys[h]
        n = self._held.get(key, 0) - 1
        if n > 0:
            self._held[key] = n
        else:
            self._held.pop(key, None)


def _salt(extra: Any, adapter: str | None) -> str | None:
    """The ``cache_salt`` among a block's extra keys as vLLM publishes them: the adapter's name
    first (when it has one), then multimodal ``[id, offset]`` pairs, the salt, prompt-embedding
    digests (bytes)."""
    items = list(extra) if isinstance(extra, (list, tuple)) else []
    if adapter and items and items[0] == adapter:
        items = items[1:]
    return next((k for k in items if isinstance(k, str)), None)


def _hashable(h: Any) -> Hashable:
    return bytes(h) if isinstance(h, (bytes, bytearray, memoryview)) else h
