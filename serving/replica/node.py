"""Where a model replica's engine runs on its node: the address Ray knows the node by, a free port
there, the GPUs of the replica's placement group (a multi-rank GPU engine) and the CPU cores a CPU
engine claims (:mod:`serving.replica.placement`)."""

from __future__ import annotations

import logging
import os
import socket

from serving.replica.engine import EngineSpec
from serving.replica.placement import claim_cores

logger = logging.getLogger("ray.serve")

__all__ = ["engine_cores", "free_port", "node_ip", "placement_group_gpus"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def node_ip() -> str:
    """The address Ray itself uses for this node (127.0.0.1 for the local stack, the pod IP on
    Kubernetes), not whatever interface a routing lookup would pick."""
    try:
        import ray

        if not ray.is_initialized():  # ray.nodes() would start a local Ray instance of its own
            return "127.0.0.1"
        node_id = ray.get_runtime_context().get_node_id()
        for node in ray.nodes():
            if node.get("NodeID") == node_id:
                return str(node["NodeManagerAddress"])
    except Exception:  # not inside Ray (unit use)
        pass
    return "127.0.0.1"


def placement_group_gpus(spec: EngineSpec) -> str | None:
    """CUDA_VISIBLE_DEVICES for a multi-rank GPU engine: this replica's GPU (bundle 0) plus the
    GPU Ray assigned to each other bundle of the replica's placement group (one per rank, packed
    on this node). Ray hides those from the replica actor itself, which holds only rank 0's."""
    if not spec.use_gpu or spec.world_size <= 1:
        return None
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = ray.util.get_current_placement_group()
    if pg is None:
        raise RuntimeError("a multi-rank GPU engine must run in its placement group")

    @ray.remote(num_cpus=0)
    def gpu_ids() -> list[str]:
        return [str(i) for i in ray.get_gpu_ids()]

    refs = [
        gpu_ids.options(
            num_gpus=spec.gpus_per_rank,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
        ).remote()
        for i in range(1, spec.world_size)
    ]
    ids = [str(i) for i in ray.get_gpu_ids()] + [g for ids in ray.get(refs) for g in ids]
    return ",".join(dict.fromkeys(ids))


def engine_cores(spec: EngineSpec) -> list[int] | None:
    """Cores for a CPU engine, as many as its placement group reserved (``cpus_per_rank`` per
    rank), apart from the other engines on this node where the node has enough. A multi-rank
    engine's ranks are bound to them by vLLM; a single-process engine is pinned to them once it
    runs, if the node keeps a core no engine claims (``ModelServer._pin``)."""
    if spec.use_gpu:
        return None
    try:
        cores = claim_cores(spec.world_size * max(1, int(spec.cpus_per_rank)), os.getpid())
    except OSError as exc:  # no writable /dev/shm: vLLM binds by itself
        logger.warning("no core ledger (%s); vLLM chooses its cores", exc)
        return None
    logger.info("engine cores %s", cores)
    return cores
