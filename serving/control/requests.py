"""What ``serving promote``, ``serving rollback`` and ``serving promotions`` do: write a request
into the store for the promotion controller, follow the promotion's record, print the history.

The CLI talks to the controller only through the store (``serving.record``): a request is
a file the controller takes at its next poll, and progress is the promotion's record, which the
controller writes before each step. So the admin credential is write access to the store (the
checkpoint volume or bucket), never a tenant's API key, and a request made while the controller
restarts is not lost.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from serving.config import StackConfig
from serving.control.controller import with_live
from serving.record import ControlStore, PromotionRecord, PromotionRequest

__all__ = ["controller_alive", "follow", "format_record", "live_config", "submit"]


def live_config(cfg: StackConfig, control: ControlStore) -> StackConfig:
    """The stack config with the store's record of live versions applied (what serves)."""
    recorded = control.live()
    names = {m.name for m in cfg.models}
    return with_live(cfg, {m: [v.entry() for v in vs] for m, vs in recorded.items() if m in names})


def controller_alive(control: ControlStore, clock: Callable[[], float] = time.time) -> bool:
    lock = control.lease.read()
    return bool(lock and float(lock.get("expires_at", 0)) > clock())


def submit(
    control: ControlStore, model: str, action: str, version: str | None, overrides: dict[str, Any]
) -> tuple[float, str]:
    """Queue a request for the controller; returns when it was made and its key in the queue."""
    at = time.time()
    request = PromotionRequest(action=action, version=version, overrides=overrides, at=at)  # type: ignore[arg-type]
    return at, control.submit(model, request)


def _when(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S")


def _figures(fig: dict[str, float | None]) -> str:
    def show(k: str, v: float | None) -> str:
        if v is None:
            return f"{k}=-"
        if "ttft" in k:
            return f"{k}={v * 1000:.0f}ms"
        return f"{k}={v:g}"

    return " ".join(show(k, v) for k, v in fig.items())


def format_step(step: Any) -> str:
    weights = " ".join(f"{v}={w}%" for v, w in step.weights.items())
    parts = [f"  {_when(step.at)} {step.phase:9}", weights, step.note, _figures(step.figures)]
    return " ".join(p for p in parts if p)


def format_record(rec: PromotionRecord) -> str:
    head = f"{rec.model}@{rec.version} (from {rec.previous}, {rec.source}) {rec.status}"
    head += f" {_when(rec.created_at)} .. {_when(rec.updated_at)}"
    if rec.reason:
        head += f"\n  reason: {rec.reason}"
    return "\n".join([head, *(format_step(s) for s in rec.steps)])


def follow(
    control: ControlStore,
    model: str,
    since: float,
    version: str | None,
    out: Callable[[str], None],
    timeout_s: float,
    poll_s: float = 1.0,
) -> PromotionRecord | None:
    """Print the steps of the promotion the request at ``since`` started until it ends; None if
    none started in ``timeout_s`` (no controller took the request)."""
    deadline, shown = time.monotonic() + timeout_s, 0
    while time.monotonic() < deadline:
        history = control.history(model)
        if version is not None:
            mine = [r for r in history if r.created_at >= since and r.version == version]
        else:
            mine = [r for r in history if r.updated_at >= since]
        if mine:
            rec = mine[-1]
            for step in rec.steps[shown:]:
                out(format_step(step))
            shown = len(rec.steps)
            if not rec.active:
                return rec
        time.sleep(poll_s)
    return None
