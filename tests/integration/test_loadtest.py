"""Locust against the real stack (issue 7): the short ``smoke`` scenario through ``run_scenario``,
its reports, and exit codes that follow the SLOs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtests.report import format_summary
from loadtests.run import PNG, REPORT_FILES, run_scenario
from loadtests.scenario import load_scenario
from loadtests.slo import evaluate, exit_code, load_results
from tests.conftest import Stack

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def smoke_run(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    out = tmp_path_factory.mktemp("loadtest") / "smoke"
    code = run_scenario("smoke", stack.url, out, stack.keys["main"], duration_s=20)
    return out, code


def test_smoke_scenario_meets_its_slos_and_writes_reports(smoke_run: tuple[Path, int]) -> None:
    out, code = smoke_run
    for name in REPORT_FILES:
        assert (out / name).stat().st_size > 0, name
    assert (out / PNG).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "TTFT" in (out / "report.html").read_text()
    results = load_results(out)
    slo = load_scenario("smoke").slo
    checks = evaluate(results, slo)
    assert code == exit_code(checks) == 0, format_summary("smoke", results, checks)
    # both models and both endpoints were exercised, with streamed timings recorded
    assert results.requests >= slo.min_requests and results.failures == 0
    assert results.ttft_p50_ms is not None and results.tokens_per_s > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["exit_code"] == 0 and summary["results"]["requests"] == results.requests
    stats = (out / "locust_stats.csv").read_text()
    assert "POST,chat adder" in stats and "POST,completion subtractor" in stats and "TTFT,ALL" in stats


def test_a_broken_slo_gives_a_nonzero_exit_code(smoke_run: tuple[Path, int]) -> None:
    """The same run judged by an impossible threshold (a pure function of the CSV): exit 1."""
    out, _ = smoke_run
    results = load_results(out)
    strict = load_scenario("smoke").slo.model_copy(update={"ttft_p99_ms": 0.001})
    checks = evaluate(results, strict)
    assert exit_code(checks) == 1
    assert [c.name for c in checks if not c.ok] == ["ttft_p99_ms"]


def test_run_fails_when_requests_fail(stack: Stack, tmp_path: Path) -> None:
    """A short run with a wrong API key: every request is refused, the error-rate SLO breaks."""
    out = tmp_path / "badkey"
    code = run_scenario("smoke", stack.url, out, "sk-not-a-valid-key", duration_s=4)
    assert code == 1
    results = load_results(out)
    assert results.requests > 0 and results.failures == results.requests
    assert "401" in (out / "locust_failures.csv").read_text()
