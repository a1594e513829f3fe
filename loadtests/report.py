"""Plots and tables for load-test and benchmark reports (matplotlib, headless)."""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path
from typing import Any

from loadtests.slo import ALL, CSV_PREFIX, Check, Results

__all__ = ["format_summary", "plot_history", "read_history"]


def read_history(out_dir: str | Path) -> list[dict[str, str]]:
    with open(Path(out_dir) / f"{CSV_PREFIX}_stats_history.csv", newline="") as f:
        return list(csv.DictReader(f))


def _f(v: str | None) -> float | None:
    try:
        return float(v) if v not in (None, "", "N/A") else None
    except ValueError:
        return None


def history_series(rows: list[dict[str, str]]) -> dict[str, list[tuple[float, float | None]]]:
    """Per-second series: users, requests/s, tokens/s, errors/s (from cumulative POST counters) and
    TTFT p50/p99, ITL p50 (Locust's ~10 s rolling window), with time in seconds from the start."""
    posts: dict[float, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])  # requests, tokens, failures
    users: dict[float, float] = {}
    lat: dict[str, list[tuple[float, float | None]]] = defaultdict(list)
    for r in rows:
        t = float(r["Timestamp"])
        users[t] = float(r["User Count"])
        if r["Type"] == "POST":
            n = float(r["Total Request Count"])
            acc = posts[t]
            acc[0] += n
            acc[1] += n * (_f(r["Total Average Content Size"]) or 0.0)
            acc[2] += float(r["Total Failure Count"])
        elif r["Name"] == ALL and r["Type"] in ("TTFT", "ITL") and r["Total Request Count"] != "0":
            lat[f"{r['Type']} p50"].append((t, _f(r["50%"])))
            if r["Type"] == "TTFT":
                lat["TTFT p99"].append((t, _f(r["99%"])))
    if not users:
        return {}
    t0 = min(users)
    out: dict[str, list[tuple[float, float | None]]] = {"users": [(t - t0, u) for t, u in sorted(users.items())]}
    ts = sorted(posts)
    for key, i in (("requests/s", 0), ("tokens/s", 1), ("errors/s", 2)):
        series: list[tuple[float, float | None]] = []
        for a, b in zip(ts, ts[1:], strict=False):
            series.append((b - t0, (posts[b][i] - posts[a][i]) / (b - a)))
        out[key] = _smooth(series, 3)
    for key, pts in lat.items():
        out[key] = [(t - t0, v) for t, v in pts]
    return out


def _smooth(pts: list[tuple[float, float | None]], k: int) -> list[tuple[float, float | None]]:
    vals = [v or 0.0 for _, v in pts]
    return [
        (t, sum(vals[max(0, i - k + 1) : i + 1]) / len(vals[max(0, i - k + 1) : i + 1])) for i, (t, _) in enumerate(pts)
    ]


def plot_history(out_dir: str | Path, title: str, png: str | Path) -> Path:
    """Latency and throughput over time, from Locust's full stats history."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = history_series(read_history(out_dir))
    fig, (ax0, ax1, ax2) = plt.subplots(3, 1, figsize=(10, 9), sharex=True)

    def line(ax: Any, key: str, **kw: Any) -> None:
        pts = [(t, v) for t, v in s.get(key, []) if v is not None]
        if pts:
            ax.plot([t for t, _ in pts], [v for _, v in pts], label=key, **kw)

    line(ax0, "tokens/s", color="tab:blue")
    ax0.set_ylabel("output tokens/s")
    ax0.set_title(title)
    line(ax1, "requests/s", color="tab:green")
    line(ax1, "errors/s", color="tab:red")
    ax1.set_ylabel("requests/s")
    users_ax = ax1.twinx()
    line(users_ax, "users", color="grey", linestyle="--", drawstyle="steps-post")
    users_ax.set_ylabel("users")
    h1, l1 = ax1.get_legend_handles_labels()
    h2, l2 = users_ax.get_legend_handles_labels()
    ax1.legend(h1 + h2, l1 + l2, loc="upper left", fontsize="small")
    line(ax2, "TTFT p50", color="tab:orange")
    line(ax2, "TTFT p99", color="tab:red")
    line(ax2, "ITL p50", color="tab:purple")
    ax2.set_ylabel("ms (10 s window)")
    ax2.set_xlabel("seconds")
    ax2.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return Path(png)


def format_summary(name: str, r: Results, checks: list[Check]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f} ms"

    lines = [
        f"scenario {name}: {r.requests} requests, {r.failures} failed ({r.error_rate:.2%})",
        f"  throughput  {r.requests_per_s:.2f} req/s, {r.tokens_per_s:.1f} output tokens/s",
        f"  TTFT        p50 {ms(r.ttft_p50_ms)}, p99 {ms(r.ttft_p99_ms)}",
        f"  ITL         p50 {ms(r.itl_p50_ms)}, p99 {ms(r.itl_p99_ms)}",
        "SLOs:",
        *(f"  {c}" for c in checks),
    ]
    return "\n".join(lines)
