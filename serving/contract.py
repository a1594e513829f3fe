"""The contract between gateway replicas and model replicas: the only module both import.

A model replica runs vLLM's OpenAI server on a private port guarded by a per-replica token. It
tells gateways where that server is in two ways, and both carry the types defined here:

- **Published endpoint records** in Ray's GCS key-value store, under ``ep/<app>/<replica>`` in
  namespace ``raystack``: URL, token, a heartbeat sequence number and a state (``up``, or
  ``hung`` when the replica found its engine making no progress), re-published every
  ``HEARTBEAT_S`` while the engine runs and deleted when the replica drains. Gateways read them
  every ``REFRESH_S`` and pick a replica with no Ray call per request
  (:mod:`serving.gateway.replicas`).
- **A lease**: the model replica's streaming Serve method ``lease(hint)`` yields its
  :class:`Endpoint` and stays open while the request runs. :class:`LeaseHint` is what Serve's
  request routers may look at.
- **A KV-block stream** (``router: kv_aware``): a record's ``events`` URL, guarded by the same
  token, streams which prompt blocks the replica's engine holds in its prefix cache, as keys of
  :func:`block_keys` (hashes, never tokens or text); the gateway computes the same keys from each
  request's tokens (:mod:`serving.gateway.kv_index`).

``RUNNING_REQUESTS_KEY`` is the key both kinds of replica report their load under to Serve's
autoscaler (``record_autoscaling_stats``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

logger = logging.getLogger("serving.contract")

__all__ = [
    "HEARTBEAT_S",
    "HUNG",
    "KV",
    "NAMESPACE",
    "REFRESH_S",
    "RUNNING_REQUESTS_KEY",
    "UP",
    "AdapterRefused",
    "BlockKey",
    "Endpoint",
    "LeaseHint",
    "RayKV",
    "Record",
    "block_keys",
    "chain_key",
    "publish",
    "read_records",
    "withdraw",
]

NAMESPACE = "raystack"
PREFIX = "ep/"
HEARTBEAT_S = 2.0  # a model replica re-publishes its record this often
REFRESH_S = 1.0  # a gateway re-reads all records this often
UP, HUNG = "up", "hung"

try:  # the key Serve's default autoscaling policy reads from a replica's report
    from ray.serve._private.common import RUNNING_REQUESTS_KEY
except ImportError:  # pragma: no cover - tests/unit/test_gateway_listener.py fails loudly if it moves
    RUNNING_REQUESTS_KEY = "running_requests"


class AdapterRefused(Exception):
    """A LoRA adapter a base replica will not register: failing verification against its
    manifest, above the engine's rank, or refused by vLLM (one the replica's configuration does not
    list yet is a replica-level refusal, retried elsewhere). A lease raises
    it; every replica of the base would refuse it the same way, so the gateway answers with it
    instead of trying another replica."""


@dataclass(frozen=True)
class LeaseHint:
    """What request routers may look at. ``prompt`` is set only for prefix-affinity routing
    (ray.serve.llm's PrefixCacheAffinityRouter reads ``.prompt``); ``session_id`` for session
    affinity; ``adapter`` (``name@version``) for a request to a LoRA adapter, which the replica
    registers with its engine before it yields its endpoint; ``blocks`` for ``router: kv_aware``."""

    prompt: str | None = None
    session_id: str | None = None
    adapter: str | None = None
    blocks: tuple[BlockKey, ...] | None = None  # router kv_aware: the prompt's block keys (the gateway's own pick)


@dataclass(frozen=True)
class Endpoint:
    """Where one model replica's vLLM server answers, and the token it requires."""

    url: str
    token: str
    replica: str


BlockKey = int  # 64 bits of a block's chained hash


def chain_key(parent: BlockKey | None, adapter: str | None, tokens: Sequence[int], salt: str | None = None) -> BlockKey:
    """The key of one full KV block: a hash of the previous block's key, the LoRA adapter the
    engine computed it for (vLLM keeps an adapter's blocks apart), the block's token ids and, for
    a sequence's first block, the request's ``cache_salt`` (vLLM hashes it into that block only,
    and the chain carries it to the rest)."""
    h = hashlib.blake2b(digest_size=8)
    h.update((parent or 0).to_bytes(8, "little"))
    h.update((adapter or "").encode())
    h.update(b"\x00")
    h.update(array("q", tokens).tobytes())
    if salt:
        h.update(b"\x01" + salt.encode())
    return int.from_bytes(h.digest(), "little")


def block_keys(
    tokens: Sequence[int], block_size: int, adapter: str | None = None, salt: str | None = None
) -> list[BlockKey]:
    """The keys of the full blocks of a prompt's tokens, in order (a partial last block is not
    cached by the engine, so it has none); ``salt``: the request's ``cache_salt``."""
    keys: list[BlockKey] = []
    parent: BlockKey | None = None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = chain_key(parent, adapter, tokens[start : start + block_size], salt if parent is None else None)
        keys.append(parent)
    return keys


class KV(Protocol):
    def put(self, key: str, value: bytes) -> None: ...

    def delete(self, key: str) -> None: ...

    def scan(self, prefix: str) -> dict[str, bytes]: ...


class RayKV:
    """Ray's GCS key-value store (the process must be connected to Ray, as Serve replicas are)."""

    def put(self, key: str, value: bytes) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(key, value, overwrite=True, namespace=NAMESPACE)

    def delete(self, key: str) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(key, namespace=NAMESPACE)

    def scan(self, prefix: str) -> dict[str, bytes]:
        from ray.experimental import internal_kv

        out: dict[str, bytes] = {}
        for key in internal_kv._internal_kv_list(prefix, namespace=NAMESPACE):
            name = key.decode() if isinstance(key, bytes) else key
            value = internal_kv._internal_kv_get(name, namespace=NAMESPACE)
            if value is not None:
                out[name] = value
        return out


@dataclass(frozen=True)
class Record:
    """One replica's endpoint. ``seq`` counts its heartbeats (only a change matters to readers);
    ``state`` is ``up``, or ``hung`` when the replica found its engine making no progress;
    ``adapters``: the LoRA adapters registered with its engine now (``name@version``);
    ``events``: the URL of its KV-block stream ("" when its engine publishes none)."""

    app: str
    replica: str
    url: str
    token: str
    seq: int
    state: str = UP
    adapters: frozenset[str] = frozenset()
    events: str = ""


def _key(app: str, replica: str) -> str:
    return f"{PREFIX}{app}/{replica}"


def publish(
    kv: KV,
    app: str,
    replica: str,
    url: str,
    token: str,
    seq: int,
    state: str = UP,
    adapters: tuple[str, ...] = (),
    events: str = "",
) -> None:
    record = {"url": url, "token": token, "seq": seq, "state": state, "adapters": list(adapters), "events": events}
    kv.put(_key(app, replica), json.dumps(record).encode())


def withdraw(kv: KV, app: str, replica: str) -> None:
    kv.delete(_key(app, replica))


def read_records(kv: KV) -> list[Record]:
    out = []
    for key, raw in kv.scan(PREFIX).items():
        app, _, replica = key.removeprefix(PREFIX).partition("/")
        try:
            v = json.loads(raw)
            adapters = frozenset(str(a) for a in v.get("adapters", ()))
            state, events = str(v.get("state", UP)), str(v.get("events", ""))
            out.append(Record(app, replica, str(v["url"]), str(v["token"]), int(v["seq"]), state, adapters, events))
        except (ValueError, KeyError, TypeError):
            logger.warning("ignoring an unreadable endpoint record %s", key)
    return out
