"""What a benchmark run reports: its tables (``bench.md``), its plot, the order of its rounds and
the medians over them. Shared by :mod:`loadtests.bench`, :mod:`loadtests.kv_bench` and
:mod:`loadtests.lora_bench`.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from loadtests.cpuprof import GROUPS, median_cores

__all__ = ["METRICS", "cpu_table", "median_rows", "plot", "ratio_table", "round_orders", "rounds_table"]

METRICS = (
    ("requests_per_s", "req/s", "{:.2f}"),
    ("output_tokens_per_s", "tok/s", "{:.0f}"),
    ("ttft_p50_ms", "TTFT p50 ms", "{:.0f}"),
    ("ttft_p99_ms", "TTFT p99 ms", "{:.0f}"),
    ("itl_p50_ms", "ITL p50 ms", "{:.2f}"),
)


def ratio_table(results: dict[str, list[dict[str, Any]]], base: str = "bare") -> str:
    """Markdown table; each figure followed by its ratio to ``base`` at the same concurrency."""
    head = "| server | conc | " + " | ".join(m[1] for m in METRICS) + " | failures | load |"
    lines = [head, "|" + "---|" * (len(METRICS) + 4)]
    ref = {row["concurrency"]: row for row in results.get(base, [])}
    for kind, rows in results.items():
        for row in rows:
            cells = []
            for key, _, fmt in METRICS:
                v, b = row.get(key), ref.get(row["concurrency"], {}).get(key)
                cell = "-" if v is None else fmt.format(v)
                if v is not None and b and kind != base:
                    cell += f" ({v / b:.2f}x)"
                cells.append(cell)
            lines.append(
                f"| {kind} | {row['concurrency']} | "
                + " | ".join(cells)
                + f" | {row['failures']} | {row['load_before']:.1f} |"
            )
    return "\n".join(lines)


def cpu_table(results: dict[str, list[dict[str, Any]]]) -> str:
    """Markdown table of the cores each group of processes used per server and concurrency."""
    groups = [g for g, _ in GROUPS] + ["other"]
    seen = [g for g in groups if any(g in row.get("cores_by_group", {}) for rows in results.values() for row in rows)]
    lines = ["| server | conc | " + " | ".join(seen) + " | total |", "|" + "---|" * (len(seen) + 3)]
    for kind, rows in results.items():
        for row in rows:
            cores = row.get("cores_by_group", {})
            lines.append(
                f"| {kind} | {row['concurrency']} | "
                + " | ".join(f"{cores.get(g, 0):.2f}" for g in seen)
                + f" | {sum(cores.values()):.2f} |"
            )
    return "\n".join(lines)


def plot(results: dict[str, list[dict[str, Any]]], png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = (
        ("output_tokens_per_s", "output tokens/s"),
        ("ttft_p50_ms", "TTFT p50 (ms)"),
        ("ttft_p99_ms", "TTFT p99 (ms)"),
    )
    for ax, (key, label) in zip(axes, panels, strict=True):
        for kind, rows in results.items():
            pts = [(r["concurrency"], r[key]) for r in rows if r.get(key) is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=kind)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def round_orders(servers: list[str], rounds: int) -> list[list[str]]:
    """The server order of each round: as given, then reversed, alternately (ABBA...)."""
    return [list(servers) if r % 2 == 0 else list(reversed(servers)) for r in range(rounds)]


def median_rows(per_round: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per concurrency with the median of every numeric figure over the rounds (failures
    summed); ``requests_per_s_rounds`` keeps each round's requests/s."""
    out = []
    for rows in zip(*per_round, strict=True):
        row: dict[str, Any] = {"concurrency": rows[0]["concurrency"], "rounds": len(rows)}
        for key, first in rows[0].items():
            values = [r.get(key) for r in rows]
            if key in ("concurrency", "cores_by_group", "affinity", "vllm_processes") or isinstance(first, bool):
                continue
            if key == "failures":
                row[key] = sum(values)
            elif all(isinstance(v, (int, float)) for v in values):
                row[key] = statistics.median(values)
        row["cores_by_group"] = median_cores(list(rows))
        row["requests_per_s_rounds"] = [r["requests_per_s"] for r in rows]
        out.append(row)
    return out


def rounds_table(rounds: list[dict[str, Any]], base: str = "bare") -> str:
    """Markdown table of each round's requests/s ratio and TTFT p50 difference to ``base``, per
    server and concurrency, with the median over the rounds last."""
    others = [k for k in rounds[0]["results"] if k != base]
    levels = [row["concurrency"] for row in rounds[0]["results"][base]]
    head = (
        "| round (order) | conc | " + " | ".join(f"{k} req/s / {base} | {k} TTFT p50 - {base}" for k in others) + " |"
    )
    lines = [head, "|" + "---|" * (2 + 2 * len(others))]
    ratios: dict[tuple[str, int], list[float]] = {}
    diffs: dict[tuple[str, int], list[float]] = {}
    for i, rnd in enumerate(rounds, 1):
        res = rnd["results"]
        for n, c in enumerate(levels):
            b = res[base][n]
            cells = []
            for k in others:
                r = res[k][n]
                ratio = r["requests_per_s"] / b["requests_per_s"] if b["requests_per_s"] else float("nan")
                diff = (r.get("ttft_p50_ms") or 0.0) - (b.get("ttft_p50_ms") or 0.0)
                ratios.setdefault((k, c), []).append(ratio)
                diffs.setdefault((k, c), []).append(diff)
                cells.append(f"{ratio:.2f}x | {diff:+.0f} ms")
            lines.append(f"| {i} ({','.join(rnd['order'])}) | {c} | " + " | ".join(cells) + " |")
    for c in levels:
        cells = [
            f"**{statistics.median(ratios[(k, c)]):.2f}x** | **{statistics.median(diffs[(k, c)]):+.0f} ms**"
            for k in others
        ]
        lines.append(f"| median | {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
