"""Every metric the stack exports, in one place, with bounded labels only.

Recorded through Ray's metrics API (``ray.util.metrics``): each node's Ray metrics agent
aggregates all replicas on that node and serves them on the node's metrics-export port, which
Prometheus scrapes (the Ray exporter prefixes names with ``ray_``). Labels are config-resolved
values only (model, version, tenant, status class), never raw client input.

Latency histograms have explicit buckets suited to LLM serving: TTFT from 5 ms to 60 s,
inter-token latency from 1 ms to 2 s, end-to-end from 10 ms to 10 minutes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = [
    "AdapterMetrics",
    "ControllerMetrics",
    "EngineMetrics",
    "GatewayMetrics",
    "parse_prometheus_values",
    "samples",
]

TTFT_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1, 2, 5, 10, 30, 60]
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1, 2]
E2E_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600]
# routed: split (the version was drawn by the model's traffic split) or pinned (the client named
# ``model@version``); a canary is judged on split traffic only (serving.control.watch)
REQ_KEYS = ("model", "version", "tenant", "routed")


class GatewayMetrics:
    def __init__(self) -> None:
        from ray.util import metrics as m

        keys = REQ_KEYS
        # a stream the engine ended with an error event counts by that error's status (its code:
        # 5xx from 500, else 4xx), though its client got a 200 (serving.gateway.exchange)
        self.requests = m.Counter(
            "raystack_requests",
            "Requests answered by the gateway (a stream by the engine's error event, if it sent one).",
            tag_keys=(*keys, "status_class"),
        )
        self.ttft = m.Histogram(
            "raystack_time_to_first_token_seconds",
            "Time from request arrival to the first streamed byte.",
            boundaries=TTFT_BUCKETS,
            tag_keys=keys,
        )
        self.itl = m.Histogram(
            "raystack_inter_token_latency_seconds",
            "Mean time between output tokens of a streamed response, per choice (n > 1 or several "
            "prompts are generated in parallel).",
            boundaries=ITL_BUCKETS,
            tag_keys=keys,
        )
        self.e2e = m.Histogram(
            "raystack_request_latency_seconds",
            "End-to-end request latency, from request arrival.",
            boundaries=E2E_BUCKETS,
            tag_keys=keys,
        )
        self.prompt_tokens = m.Counter("raystack_prompt_tokens", "Prompt tokens processed.", tag_keys=keys)
        self.completion_tokens = m.Counter("raystack_completion_tokens", "Completion tokens generated.", tag_keys=keys)
        self.in_flight = m.Gauge(
            "raystack_in_flight_requests", "Requests in flight at this gateway.", tag_keys=("model", "kind")
        )
        self.rate_limited = m.Counter(
            "raystack_rate_limited", "Requests refused by a tenant limit.", tag_keys=("tenant", "limit")
        )
        # answered with an error before an exchange counted them (401, 404, 400/413, a fail-closed
        # quota's 503, an unexpected 500): ``reason`` is the error's fixed code (else its type),
        # ``tenant`` "-" before authentication; 429s and shed requests are counted above and below
        self.refused = m.Counter(
            "raystack_refused_requests",
            "Requests the gateway refused before forwarding them (not rate-limited or shed ones).",
            tag_keys=("tenant", "status_class", "reason"),
        )
        self.shed = m.Counter(
            "raystack_shed",
            "Low-priority requests refused while their model was busy on this gateway replica.",
            tag_keys=("model", "tenant"),
        )
        self.retries = m.Counter(
            "raystack_retries", "Requests retried on another replica.", tag_keys=("model", "version")
        )
        self.migrations = m.Counter(
            "raystack_stream_migrations",
            "Streams broken mid-answer, by outcome: resumed (continued on another replica of the same "
            "version), failed (no replica took the continuation), refused (not continued: limit, budget, "
            "or a request the gateway does not continue).",
            tag_keys=("model", "version", "outcome"),
        )
        # ``api``: the route family (chat, completion, responses, messages, count_tokens, tokenize,
        # detokenize), a fixed set named by the route, never by the client
        self.api_requests = m.Counter(
            "raystack_api_requests",
            "Requests answered by the gateway, by API.",
            tag_keys=("api", *keys, "status_class"),
        )
        # ``op``: put | get | delete; ``result``: ok | missing | too_large | error
        self.response_store = m.Counter(
            "raystack_response_store_ops",
            "Operations on the gateway's store of Responses API responses.",
            tag_keys=("op", "tenant", "result"),
        )

    def tags(self, model: str, version: str, tenant: str, pinned: bool = False) -> dict[str, str]:
        return {"model": model, "version": version, "tenant": tenant, "routed": "pinned" if pinned else "split"}


class EngineMetrics:
    """vLLM engine gauges, bridged by each model replica from its engine's /metrics."""

    FIELDS = {
        "vllm:kv_cache_usage_perc": "kv_cache",
        "vllm:num_requests_running": "running",
        "vllm:num_requests_waiting": "waiting",
    }

    def __init__(self) -> None:
        from ray.util import metrics as m

        keys = ("model", "version", "replica")
        self.gauges: dict[str, Any] = {
            "kv_cache": m.Gauge("raystack_engine_kv_cache_usage_ratio", "vLLM KV-cache use (0-1).", tag_keys=keys),
            "running": m.Gauge("raystack_engine_requests_running", "Sequences running in vLLM.", tag_keys=keys),
            "waiting": m.Gauge("raystack_engine_requests_waiting", "Sequences queued in vLLM.", tag_keys=keys),
        }

    def set(self, values: dict[str, float], tags: dict[str, str]) -> None:
        for name, value in values.items():
            if name in self.FIELDS:  # the scrape carries more (progress counters) than is exported
                self.gauges[self.FIELDS[name]].set(value, tags=tags)


class AdapterMetrics:
    """A base replica's LoRA registrations; ``adapter`` is a configured ``name@version``."""

    def __init__(self) -> None:
        from ray.util import metrics as m

        keys = ("model", "version", "replica", "adapter")
        self.loads = m.Counter(
            "raystack_adapter_loads",
            "Adapters registered with a replica's engine (fetched and verified).",
            tag_keys=keys,
        )
        self.evictions = m.Counter(
            "raystack_adapter_evictions", "Adapters unregistered from a replica's engine.", tag_keys=keys
        )
        self.leases = m.Counter(
            "raystack_adapter_leases",
            "Adapter requests leased to a replica: outcome hit (it held the adapter) or miss (it had to load it).",
            tag_keys=(*keys, "outcome"),
        )
        self.registered = m.Gauge(
            "raystack_adapters_registered", "Adapters registered with a replica's engine now.", tag_keys=keys[:3]
        )


PROMOTION_PHASES = ("idle", "deploying", "stepping", "finishing")


class ControllerMetrics:
    """The promotion controller's state: per model the phase (one series per fixed phase, 1 for
    the current one), per deployed model version its traffic weight, and whether this controller
    holds the store lock. Versions are those of the record (deployed ones), so labels stay bounded."""

    def __init__(self) -> None:
        from ray.util import metrics as m

        self.phase = m.Gauge(
            "raystack_promotion_phase", "1 for the model's current promotion phase.", tag_keys=("model", "phase")
        )
        self.weight = m.Gauge(
            "raystack_promotion_weight_percent", "Traffic weight of a deployed version.", tag_keys=("model", "version")
        )
        self.lock = m.Gauge("raystack_promotion_controller_active", "1 if this controller holds the store lock.")
        self._versions: dict[str, set[str]] = {}

    def observe(self, model: str, weights: dict[str, int], phase: str) -> None:
        for p in PROMOTION_PHASES:
            self.phase.set(1.0 if p == phase else 0.0, tags={"model": model, "phase": p})
        gone = self._versions.get(model, set()) - set(weights)
        for v in gone:  # removed versions drop to 0 and are forgotten
            self.weight.set(0.0, tags={"model": model, "version": v})
        for v, w in weights.items():
            self.weight.set(float(w), tags={"model": model, "version": v})
        self._versions[model] = set(weights)

    def active(self, held: bool) -> None:
        self.lock.set(1.0 if held else 0.0)


def samples(
    text: str, contains: str = "", names: set[str] | None = None
) -> Iterator[tuple[str, dict[str, str], float]]:
    """Each sample of a Prometheus text exposition as (name, labels, value), skipping lines that do
    not contain ``contains``, samples not in ``names`` (when given; their labels are not parsed)
    and lines that do not parse.

    Our own line parser, not ``prometheus_client.parser``: a model replica reads its engine's
    exposition every second, and the library's parser, which builds a metric family object per
    metric, cost many times the CPU per read (docs/performance.md, "Metrics parsing")."""
    for line in text.splitlines():
        if not line or line[0] == "#" or contains not in line:
            continue
        head, _, value = line.rpartition(" ")
        name, _, rest = head.partition("{")
        if names is not None and name not in names:
            continue
        labels: dict[str, str] = {}
        for part in rest.rstrip("}").split('",'):
            k, _, v = part.partition('="')
            if k:
                labels[k.strip(",")] = v.rstrip('"')
        try:
            yield name, labels, float(value)
        except ValueError:
            continue


def parse_prometheus_values(text: str, names: set[str]) -> dict[str, float]:
    """Sum the samples of the named metrics in a Prometheus text exposition."""
    out: dict[str, float] = {}
    for name, _, value in samples(text, names=names):
        out[name] = out.get(name, 0.0) + value
    return out
