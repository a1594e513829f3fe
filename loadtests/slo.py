"""SLO evaluation from Locust's CSV output: pure functions, so a stricter threshold can be checked
against the same run (``evaluate(load_results(dir), SLO(ttft_p99_ms=1))``) and unit-tested on a
synthetic CSV."""

from __future__ import annotations

import csv
from dataclasses import asdict, dataclass
from pathlib import Path

from loadtests.scenario import SLO

__all__ = ["CSV_PREFIX", "Check", "Results", "evaluate", "exit_code", "load_results", "parse_stats"]

CSV_PREFIX = "locust"  # Locust writes <out>/locust_stats.csv, _stats_history.csv, _failures.csv ...
ALL = "ALL"


@dataclass(frozen=True)
class Results:
    requests: int
    failures: int
    requests_per_s: float
    tokens_per_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None

    @property
    def error_rate(self) -> float:
        return self.failures / self.requests if self.requests else 0.0

    def as_dict(self) -> dict[str, float | int | None]:
        return {**asdict(self), "error_rate": self.error_rate}


@dataclass(frozen=True)
class Check:
    name: str
    value: float | None
    limit: float
    ok: bool

    def __str__(self) -> str:
        v = "no data" if self.value is None else f"{self.value:.4g}"
        return f"{'PASS' if self.ok else 'FAIL'}  {self.name}: {v} (limit {self.limit:g})"


def _num(v: str) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def parse_stats(rows: list[dict[str, str]]) -> Results:
    """Results from the rows of ``locust_stats.csv`` (see loadtests/locustfile.py for row kinds)."""
    posts = [r for r in rows if r["Type"] == "POST"]
    by_kind = {(r["Type"], r["Name"]): r for r in rows}
    ttft, itl = by_kind.get(("TTFT", ALL), {}), by_kind.get(("ITL", ALL), {})
    requests = sum(int(r["Request Count"]) for r in posts)
    return Results(
        requests=requests,
        failures=sum(int(r["Failure Count"]) for r in posts),
        requests_per_s=sum(_num(r["Requests/s"]) or 0.0 for r in posts),
        # Average Content Size of a POST row is its mean completion tokens per request.
        tokens_per_s=sum((_num(r["Requests/s"]) or 0.0) * (_num(r["Average Content Size"]) or 0.0) for r in posts),
        ttft_p50_ms=_num(ttft.get("50%", "")),
        ttft_p99_ms=_num(ttft.get("99%", "")),
        itl_p50_ms=_num(itl.get("50%", "")),
        itl_p99_ms=_num(itl.get("99%", "")),
    )


def load_results(out_dir: str | Path) -> Results:
    with open(Path(out_dir) / f"{CSV_PREFIX}_stats.csv", newline="") as f:
        return parse_stats(list(csv.DictReader(f)))


def evaluate(r: Results, slo: SLO) -> list[Check]:
    """One check per threshold the SLO sets."""
    checks = [
        Check("finished requests", r.requests, slo.min_requests, r.requests >= slo.min_requests),
        Check("error rate", r.error_rate, slo.max_error_rate, r.requests > 0 and r.error_rate <= slo.max_error_rate),
    ]
    upper = {"ttft_p99_ms": r.ttft_p99_ms, "ttft_p50_ms": r.ttft_p50_ms, "itl_p50_ms": r.itl_p50_ms}
    for name, value in upper.items():
        limit = getattr(slo, name)
        if limit is not None:
            checks.append(Check(name, value, limit, value is not None and value <= limit))
    if slo.min_tokens_per_s is not None:
        checks.append(
            Check("tokens_per_s", r.tokens_per_s, slo.min_tokens_per_s, r.tokens_per_s >= slo.min_tokens_per_s)
        )
    return checks


def exit_code(checks: list[Check]) -> int:
    """0 when every check passes, 1 when an SLO is broken."""
    return 0 if all(c.ok for c in checks) else 1
