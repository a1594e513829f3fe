"""The canary's judge: the new version against the live one over the same window.

Figures come from the gateway's own Prometheus metrics (``raystack_requests_total`` by status
class and the ``raystack_time_to_first_token_seconds`` histogram, per model and version, summed
over tenants and gateway replicas). A window is the difference of two scrapes, taken node by
node (each node's Ray metrics agent is read on its own). A node whose scrape failed at either end,
or that was up at only one of them, is left out of the window's totals, since its part of it is
unknown (counting its totals since it started would put traffic from before the window into it),
and so is a node that counted less at the end than at the start (whatever restarted there, what
it had counted left the sum). :func:`unseen` names such nodes: a window with such a node
never passes a step (the controller watches the step again from a fresh scrape,
serving.control.canary). Percentiles are read from the histogram buckets (linear within a bucket,
as Prometheus' ``histogram_quantile``).

The verdicts, in order:

- ``extend``: the new version answered fewer than ``min_requests`` in the window: too little to
  judge, the step is watched longer (never passed).
- ``rollback``: its error rate exceeds the live one's by more than ``max_error_rate_increase``,
  or one of its TTFT percentiles exceeds the live one's times ``max_ttft_ratio`` plus
  ``ttft_slack_s``: the new version is worse than the live one under the same load. A step that
  leaves the live version no traffic (the last, at 100%) holds the new one to the live
  version's window before the canary (the deploy step's baseline) instead.
- ``hold``: both versions are slow: the live version's own TTFT percentiles exceed its baseline
  (the window before the canary took traffic) by the same limit while the new one stays within
  its limit of the live: the machine is overloaded, not the model bad; the step is extended.
- ``pass``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from serving.config import PromotionPolicy
from serving.metrics import samples

__all__ = [
    "Scrape",
    "Verdict",
    "VersionStats",
    "judge",
    "parse_stats",
    "percentile",
    "scrape",
    "shift",
    "unseen",
    "window",
]


@dataclass
class VersionStats:
    requests: float = 0.0
    errors: float = 0.0
    ttft_count: float = 0.0
    buckets: dict[float, float] = field(default_factory=dict)  # upper bound -> cumulative count

    def minus(self, other: VersionStats) -> VersionStats:
        return VersionStats(
            max(0.0, self.requests - other.requests),
            max(0.0, self.errors - other.errors),
            max(0.0, self.ttft_count - other.ttft_count),
            {le: max(0.0, c - other.buckets.get(le, 0.0)) for le, c in self.buckets.items()},
        )

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"requests": self.requests, "errors": self.errors, "ttft_count": self.ttft_count,
                "buckets": {repr(k): v for k, v in self.buckets.items()}}  # fmt: skip

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> VersionStats:
        b = {float(k): float(v) for k, v in d.get("buckets", {}).items()}
        return cls(float(d.get("requests", 0)), float(d.get("errors", 0)), float(d.get("ttft_count", 0)), b)


def parse_stats(text: str, model: str) -> dict[str, VersionStats]:
    """Per-version totals of one model from a Prometheus exposition (Ray's exporter prefixes ``ray_``)."""
    out: dict[str, VersionStats] = {}
    for name, labels, value in samples(text, "raystack_"):
        if labels.get("model") != model or "version" not in labels:
            continue
        if labels.get("routed") == "pinned":  # sent to model@version by a client (or the controller's own
            continue  # eval and warm-up): a tenant could aim it at a canary to pass or fail it
        s = out.setdefault(labels["version"], VersionStats())
        base = name.removeprefix("ray_")
        if base in ("raystack_requests_total", "raystack_requests"):
            s.requests += value
            if labels.get("status_class") == "5xx":
                s.errors += value
        elif base == "raystack_time_to_first_token_seconds_count":
            s.ttft_count += value
        elif base == "raystack_time_to_first_token_seconds_bucket" and "le" in labels:
            le = math.inf if labels["le"] in ("+Inf", "inf") else float(labels["le"])
            s.buckets[le] = s.buckets.get(le, 0.0) + value
    return out


@dataclass(frozen=True)
class Scrape:
    """One read of every node's metrics: per node, per version, the totals; ``unread``: the nodes
    that were up but whose metrics could not be read."""

    nodes: dict[str, dict[str, VersionStats]] = field(default_factory=dict)
    unread: frozenset[str] = frozenset()

    @property
    def listed(self) -> set[str]:
        return set(self.nodes) | self.unread


def scrape(texts: Mapping[str, str | None], model: str) -> Scrape:
    """:func:`parse_stats` of each node's exposition (node id -> text, None for a node not read)."""
    read = {node: parse_stats(text, model) for node, text in texts.items() if text is not None}
    return Scrape(read, frozenset(node for node, text in texts.items() if text is None))


def scrape_json(s: Scrape) -> dict[str, Any]:
    nodes = {node: {v: st.to_json() for v, st in versions.items()} for node, versions in s.nodes.items()}
    return {"nodes": nodes, "unread": sorted(s.unread)}


def scrape_from_json(d: dict[str, Any]) -> Scrape:
    """A scrape saved in a promotion record; one in another form reads as no node (nothing counted)."""
    nodes, unread = d.get("nodes"), d.get("unread")
    if not isinstance(nodes, dict):
        return Scrape()
    read = {n: {v: VersionStats.from_json(st) for v, st in vs.items()} for n, vs in nodes.items()}
    return Scrape(read, frozenset(str(n) for n in unread) if isinstance(unread, list) else frozenset())


def _add(total: VersionStats, s: VersionStats) -> None:
    total.requests += s.requests
    total.errors += s.errors
    total.ttft_count += s.ttft_count
    for le, c in s.buckets.items():
        total.buckets[le] = total.buckets.get(le, 0.0) + c


def window(now: Scrape, before: Scrape) -> dict[str, VersionStats]:
    """Per version, what the nodes read at both ends counted in between (module docstring)."""
    total: dict[str, VersionStats] = {}
    for node in now.nodes.keys() & before.nodes.keys():
        for v, s in now.nodes[node].items():
            _add(total.setdefault(v, VersionStats()), s.minus(before.nodes[node].get(v, VersionStats())))
    return total


def unseen(now: Scrape, before: Scrape) -> dict[str, str]:
    """The nodes whose part of the window is unknown, each with why: not read at one end (or up at
    only one), or counting less at the end than at the start (whatever restarted there, what it
    had counted is gone from the sum)."""
    read = now.nodes.keys() & before.nodes.keys()
    out = {node: "not read at both ends of the window" for node in (now.listed | before.listed) - read}
    for node in read:
        if _went_back(now.nodes[node], before.nodes[node]):
            out[node] = "counted less at the window's end than at its start"
    return dict(sorted(out.items()))


def _went_back(now: dict[str, VersionStats], before: dict[str, VersionStats]) -> bool:
    for v, b in before.items():
        n = now.get(v, VersionStats())
        if n.requests < b.requests or n.errors < b.errors or n.ttft_count < b.ttft_count:
            return True
    return False


def shift(start: Scrape, before: Scrape, after: Scrape) -> Scrape:
    """The baseline ``start`` moved by what was counted between ``before`` and ``after`` (the
    controller's own requests), node by node, so a window from it leaves those out. A node not
    read at all three is marked unread: its part of the window is unknown."""
    out: dict[str, dict[str, VersionStats]] = {}
    for node in start.nodes.keys() & before.nodes.keys() & after.nodes.keys():
        until = {v: s.minus(start.nodes[node].get(v, VersionStats())) for v, s in before.nodes[node].items()}
        out[node] = {v: s.minus(until.get(v, VersionStats())) for v, s in after.nodes[node].items()}
    return Scrape(out, frozenset((start.listed | before.listed | after.listed) - out.keys()))


def percentile(s: VersionStats, q: float) -> float | None:
    """The ``q`` quantile of the TTFT histogram (None without observations)."""
    bounds = sorted(s.buckets)
    total = s.buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for le in bounds:
        count = s.buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower  # beyond the last finite bucket: its bound is all we know
            inside = count - below
            return lower + (le - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = le, count
    return lower


@dataclass(frozen=True)
class Verdict:
    action: Literal["pass", "extend", "hold", "rollback"]
    reason: str
    figures: dict[str, float | None]


def _limit(live: float, p: PromotionPolicy) -> float:
    return live * p.max_ttft_ratio + p.ttft_slack_s


def judge(live: VersionStats, new: VersionStats, baseline: VersionStats | None, p: PromotionPolicy) -> Verdict:
    """The verdict on one window (module docstring); ``baseline`` is the live version's window
    before the canary took traffic (None if it saw none)."""
    fig: dict[str, float | None] = {
        "new_requests": new.requests,
        "live_requests": live.requests,
        "new_error_rate": round(new.error_rate, 4),
        "live_error_rate": round(live.error_rate, 4),
    }
    for q in p.ttft_percentiles:
        tag = f"p{round(q * 100)}"
        fig[f"new_ttft_{tag}"] = percentile(new, q)
        fig[f"live_ttft_{tag}"] = percentile(live, q)
        fig[f"baseline_ttft_{tag}"] = percentile(baseline, q) if baseline else None
    if new.requests < p.min_requests:
        return Verdict("extend", f"{new.requests:.0f} requests to the new version, fewer than {p.min_requests}", fig)
    # the live version took no traffic in the window (the 100% step): the new one is held to the
    # live version's window before the canary
    ref, name = live, "live"
    if live.requests == 0 and baseline is not None:
        ref, name = baseline, "live before the canary"
    if new.error_rate > ref.error_rate + p.max_error_rate_increase:
        return Verdict("rollback", f"error rate {new.error_rate:.1%} vs {name} {ref.error_rate:.1%}", fig)
    overloaded = []
    for q in p.ttft_percentiles:
        tag = f"p{round(q * 100)}"
        n, lv, b = fig[f"new_ttft_{tag}"], fig[f"live_ttft_{tag}"], fig[f"baseline_ttft_{tag}"]
        against = lv if ref is live else b
        if n is None or against is None:
            continue
        if n > _limit(against, p):
            ms = f"{n * 1000:.0f} ms vs {name} {against * 1000:.0f} ms (limit {_limit(against, p) * 1000:.0f} ms)"
            return Verdict("rollback", f"TTFT {tag} {ms}: the new version is slow", fig)
        if lv is not None and b is not None and lv > _limit(b, p):
            overloaded.append(f"{tag} live {lv * 1000:.0f} ms vs {b * 1000:.0f} ms before the canary")
    if overloaded:
        return Verdict("hold", "both versions slow (overload, not the model): " + ", ".join(overloaded), fig)
    return Verdict("pass", "within the limits", fig)
