"""Run one load-test scenario headless against a base URL; exit non-zero when an SLO is broken.

    python -m loadtests.run --scenario single-model --base-url http://127.0.0.1:8000 \
        [--api-key-env OPENAI_API_KEY] [--out reports/single-model] [--duration 30] [--model NAME]

Locust runs as a subprocess (it monkey-patches the standard library with gevent, which must not
leak into the caller, e.g. pytest or the ``serving`` CLI). Written to ``--out``:
``locust_stats.csv``, ``locust_stats_history.csv``, ``locust_failures.csv`` (Locust's CSVs),
``report.html`` (Locust's HTML report), ``latency_throughput.png`` and ``summary.json``.
Exit codes: 0 all SLOs met, 1 an SLO broken, 2 the run itself failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from loadtests.report import format_summary, plot_history
from loadtests.scenario import ScenarioError, load_scenario, scenario_names
from loadtests.slo import CSV_PREFIX, evaluate, exit_code, load_results

__all__ = ["LOCUSTFILE", "REPORT_FILES", "main", "run_scenario"]

ROOT = Path(__file__).resolve().parents[1]
LOCUSTFILE = Path(__file__).resolve().with_name("locustfile.py")
PNG = "latency_throughput.png"
REPORT_FILES = (f"{CSV_PREFIX}_stats.csv", f"{CSV_PREFIX}_stats_history.csv", "report.html", PNG, "summary.json")


def _locust_env(
    scenario: Path | str, duration_s: float | None, api_key: str | None, model: str | None
) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    path = Path(scenario)  # a file path must survive Locust's other working directory
    env["LOADTEST_SCENARIO"] = str(path.resolve()) if path.is_file() else str(scenario)
    env["LOADTEST_DURATION_S"] = str(duration_s or "")
    env["LOADTEST_MODEL"] = model or ""
    if api_key:
        env["OPENAI_API_KEY"] = api_key
    return env


def run_scenario(
    scenario: str,
    base_url: str,
    out_dir: Path,
    api_key: str | None,
    duration_s: float | None,
    model: str | None = None,
    log: Callable[[str], None] = print,
) -> int:
    """Run ``scenario`` (name or path) against ``base_url``; write reports to ``out_dir``.

    ``duration_s`` stretches or shrinks the scenario's load shape to that total length; ``model``
    sends every request to one model. Returns the exit code (0 ok, 1 SLO broken, 2 run failed).
    """
    try:
        sc = load_scenario(scenario).scaled(duration_s).with_model(model)
    except ScenarioError as exc:
        log(str(exc))
        return 2
    out_dir = Path(out_dir).resolve()  # Locust runs in the repository root
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOCUSTFILE),
        "--headless",
        "--host",
        base_url.rstrip("/"),
        "--csv",
        str(out_dir / CSV_PREFIX),
        "--csv-full-history",
        "--html",
        str(out_dir / "report.html"),
        "--stop-timeout",
        str(int(sc.timeout_s)),
        "--loglevel",
        "WARNING",
        "--only-summary",
    ]
    log(f"running scenario {sc.name!r} for {sc.duration_s:.0f}s against {base_url} -> {out_dir}")
    started = time.monotonic()
    try:
        proc = subprocess.run(
            cmd,
            cwd=ROOT,
            env=_locust_env(scenario, duration_s, api_key, model),
            capture_output=True,
            text=True,
            timeout=sc.duration_s + sc.timeout_s + 120,
        )
    except subprocess.TimeoutExpired:
        log("locust did not finish in time")
        return 2
    (out_dir / "locust.log").write_text(proc.stdout + proc.stderr)
    if not (out_dir / f"{CSV_PREFIX}_stats.csv").exists():
        log(f"locust failed (exit {proc.returncode}); see {out_dir / 'locust.log'}:\n{proc.stderr[-2000:]}")
        return 2
    results = load_results(out_dir)
    checks = evaluate(results, sc.slo)
    code = exit_code(checks)
    plot_history(out_dir, f"{sc.name} against {base_url}", out_dir / PNG)
    summary = {
        "scenario": sc.name,
        "base_url": base_url,
        "duration_s": sc.duration_s,
        "wall_s": round(time.monotonic() - started, 1),
        "results": results.as_dict(),
        "checks": [{"name": c.name, "value": c.value, "limit": c.limit, "ok": c.ok} for c in checks],
        "exit_code": code,
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(format_summary(sc.name, results, checks))
    return code


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m loadtests.run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--scenario", help=f"name ({', '.join(scenario_names())}) or path")
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key-env", default="OPENAI_API_KEY", help="environment variable holding the key")
    ap.add_argument("--out", type=Path, default=None, help="default: reports/<scenario>-<time>")
    ap.add_argument("--duration", type=float, default=None, help="seconds (stretches the load shape)")
    ap.add_argument("--model", default=None, help="send every request to this model")
    ap.add_argument("--list", action="store_true", help="list the scenarios and exit")
    a = ap.parse_args(argv)
    if a.list or not a.scenario:
        for name in scenario_names():
            print(f"{name:16} {load_scenario(name).description}")
        sys.exit(0 if a.list else 2)
    out = a.out or Path("reports") / f"{Path(a.scenario).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    sys.exit(run_scenario(a.scenario, a.base_url, out, os.environ.get(a.api_key_env) or None, a.duration, a.model))


if __name__ == "__main__":
    main()
