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
    """Markdown table; each figure followed by its ratio to ``base`` at the same concurrency. A
    median over fewer rounds than all (``figure_rounds`` of :func:`median_rows`) gets a footnote."""
    head = "| server | conc | " + " | ".join(m[1] for m in METRICS) + " | failures | load |"
    lines = [head, "|" + "---|" * (len(METRICS) + 4)]
    notes: list[str] = []
    ref = {row["concurrency"]: row for row in results.get(base, [])}
    for kind, rows in results.items():
        for row in rows:
            cells = []
            for key, label, fmt in METRICS:
                v, b = row.get(key), ref.get(row["concurrency"], {}).get(key)
                cell = "-" if v is None else fmt.format(v)
                if v is not None and b and kind != base:
                    cell += f" ({v / b:.2f}x)"
                have = row.get("figure_rounds", {}).get(key)
                if v is not None and have:
                    notes.append(
                        f"[{len(notes) + 1}] {kind} {label} at conc {row['concurrency']}: "
                        f"median over {have} of {row['rounds']} rounds (the others lack it)"
                    )
                    cell += f" [{len(notes)}]"
                cells.append(cell)
            lines.append(
                f"| {kind} | {row['concurrency']} | "
                + " | ".join(cells)
                + f" | {row['failures']} | {row['load_before']:.1f} |"
            )
    return "\n".join(lines + ([""] + notes if notes else []))


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
    """One row per concurrency with the median of every numeric figure over the rounds that have
    it (failures summed); ``requests_per_s_rounds`` keeps each round's requests/s, and
    ``figure_rounds`` (only when some round lacks a figure, e.g. no TTFT in a round where every
    request failed) how many rounds each such median is over."""
    out = []
    for rows in zip(*per_round, strict=True):
        row: dict[str, Any] = {"concurrency": rows[0]["concurrency"], "rounds": len(rows)}
        partial: dict[str, int] = {}
        for key in dict.fromkeys(k for r in rows for k in r):
            if key in ("concurrency", "cores_by_group", "affinity", "vllm_processes"):
                continue
            raw = [r.get(key) for r in rows]
            if any(isinstance(v, bool) for v in raw):
                continue
            values = [v for v in raw if isinstance(v, (int, float))]
            if key == "failures":
                row[key] = sum(values)
            elif values and all(v is None or isinstance(v, (int, float)) for v in raw):
                row[key] = statistics.median(values)
                if len(values) < len(rows):
                    partial[key] = len(values)
        row["cores_by_group"] = median_cores(list(rows))
        row["requests_per_s_rounds"] = [r["requests_per_s"] for r in rows]
        if partial:
            row["figure_rounds"] = partial
        out.append(row)
    return out


def _ratio(v: float | None, b: float | None) -> float | None:
    return None if v is None or not b else v / b


def _diff(v: float | None, b: float | None) -> float | None:
    return None if v is None or b is None else v - b


def _median(values: list[float | None], fmt: str, total: int, what: str, notes: list[str]) -> str:
    """The median of the values that are there, bold; a footnote when fewer than ``total`` are."""
    have = [v for v in values if v is not None]
    if not have:
        return "-"
    cell = f"**{fmt.format(statistics.median(have))}**"
    if len(have) < total:
        notes.append(f"[{len(notes) + 1}] {what}: median over {len(have)} of {total} rounds (the others lack it)")
        cell += f" [{len(notes)}]"
    return cell


def rounds_table(rounds: list[dict[str, Any]], base: str = "bare") -> str:
    """Markdown table of each round's requests/s ratio and TTFT p50 difference to ``base`` and
    every server's failures, per server and concurrency, with the medians over the rounds last
    (failures: their sum). "-" where either side lacks the figure (no TTFT when every request
    failed, no ratio to 0 requests/s); a median over fewer rounds than all gets a footnote."""
    others = [k for k in rounds[0]["results"] if k != base]
    levels = [row["concurrency"] for row in rounds[0]["results"][base]]
    cols = [f"{k} req/s / {base} | {k} TTFT p50 - {base} | {k} failures" for k in others]
    lines = [f"| round (order) | conc | {' | '.join(cols)} | {base} failures |", "|" + "---|" * (3 + 3 * len(others))]
    ratios: dict[tuple[str, int], list[float | None]] = {}
    diffs: dict[tuple[str, int], list[float | None]] = {}
    fails: dict[tuple[str, int], int] = {}
    for i, rnd in enumerate(rounds, 1):
        res = rnd["results"]
        for n, c in enumerate(levels):
            b = res[base][n]
            cells = []
            for k in [*others, base]:
                r = res[k][n]
                fails[(k, c)] = fails.get((k, c), 0) + r.get("failures", 0)
                if k == base:
                    cells.append(str(r.get("failures", 0)))
                    continue
                ratio = _ratio(r.get("requests_per_s"), b.get("requests_per_s"))
                diff = _diff(r.get("ttft_p50_ms"), b.get("ttft_p50_ms"))
                ratios.setdefault((k, c), []).append(ratio)
                diffs.setdefault((k, c), []).append(diff)
                cells.append(
                    ("-" if ratio is None else f"{ratio:.2f}x")
                    + (" | -" if diff is None else f" | {diff:+.0f} ms")
                    + f" | {r.get('failures', 0)}"
                )
            lines.append(f"| {i} ({','.join(rnd['order'])}) | {c} | " + " | ".join(cells) + " |")
    notes: list[str] = []
    for c in levels:
        cells = [
            _median(ratios[(k, c)], "{:.2f}x", len(rounds), f"{k} req/s / {base} at conc {c}", notes)
            + " | "
            + _median(diffs[(k, c)], "{:+.0f} ms", len(rounds), f"{k} TTFT p50 - {base} at conc {c}", notes)
            + f" | {fails[(k, c)]} in all"
            for k in others
        ]
        lines.append(f"| median | {c} | " + " | ".join(cells) + f" | {fails[(base, c)]} in all |")
    return "\n".join(lines + ([""] + notes if notes else []))
