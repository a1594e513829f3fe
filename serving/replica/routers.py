"""Replica-selection policies, chosen per model in the stack config.

- ``power_of_two``: Ray Serve's default (two random replicas, the shorter queue wins).
- ``prefix_affinity``: ``ray.serve.llm``'s PrefixCacheAffinityRouter, reused as it is; the lease
  carries the leading prompt text in ``LeaseHint.prompt``, which that router reads.
- ``kv_aware``: chosen in the gateway from the engines' KV events (:mod:`serving.gateway.kv_index`);
  a request it leases through Serve (a cold app) gets Serve's default.
- ``session_affinity``: below; one ``x-session-id`` always goes to the same live replica
  (rendezvous hashing, so a scale event moves only the sessions of the replica that changed).
"""

from __future__ import annotations

import hashlib

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RunningReplica

__all__ = ["ROUTER_CLASSES", "SessionAffinityRouter", "pick_by_session"]

ROUTER_CLASSES = {
    "power_of_two": None,
    "prefix_affinity": "ray.serve.llm.request_router:PrefixCacheAffinityRouter",
    "session_affinity": "serving.replica.routers:SessionAffinityRouter",
    "kv_aware": None,  # picked by the gateway (serving.gateway.kv_index); Serve's default when it leases
}


def pick_by_session(session_id: str, replica_ids: list[str]) -> str:
    """Rendezvous (highest random weight) hashing of a session over replica ids."""
    return max(replica_ids, key=lambda r: hashlib.blake2b(f"{session_id}|{r}".encode(), digest_size=8).digest())


def _session_of(pending: PendingRequest | None) -> str | None:
    if pending is None:
        return None
    for arg in pending.args:
        sid = getattr(arg, "session_id", None)
        if isinstance(sid, str) and sid:
            return sid
    return None


class SessionAffinityRouter(PowerOfTwoChoicesRequestRouter):
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        sid = _session_of(pending_request)
        if sid is None or not candidate_replicas:
            return await super().choose_replicas(candidate_replicas, pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        return [[by_id[pick_by_session(sid, sorted(by_id))]]]
