"""The benchmark itself, end to end at smoke size: it starts our stack (vLLM's default, compiled
engine) and bare vLLM in turn, measures them with streaming clients and writes its table, JSON and
chart. Figures are not judged here (timing never decides a test): only that every server was really
measured with no failed request, and that both ran their engine on a core of its own. One round:
the order of several rounds and their medians are checked with servers that only note their start
(tests/unit/test_loadtests.py), each round here would start both servers again (about 100 s)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


def test_bench_measures_ours_and_bare_vllm(tmp_path: Path) -> None:
    model = tmp_path / "tiny"
    subprocess.run([sys.executable, "-m", "loadtests.models", "tiny", "--out", str(model)], check=True, timeout=300)
    out = tmp_path / "bench"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtests.bench",
            "--model-dir",
            str(model),
            "--out",
            str(out),
            "--servers",
            "ours,bare",
            "--rounds",
            "1",
            "--concurrency",
            "1",
            "4",
            "--requests",
            "8",
            "--settle-s",
            "0",
            "--start-timeout",
            "600",
        ],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "bench.json").read_text())
    assert "rounds" not in doc and sorted(doc["results"]) == ["bare", "ours"]
    for kind in ("ours", "bare"):
        rows = doc["results"][kind]
        assert [r["concurrency"] for r in rows] == [1, 4]
        assert all(r["failures"] == 0 and r["requests_per_s"] > 0 and r["ttft_p50_ms"] > 0 for r in rows)
        # one single-process engine on a 2-core node: EngineCore alone on its claimed core,
        # the API server on the other (serving.replica.engine.pin_single_process)
        placed = rows[0]["affinity"]
        seen = f"{kind}: {placed}, vLLM processes {rows[0]['vllm_processes']}\n{proc.stdout[-3000:]}"
        assert len(placed.get("engine core", [])) == 1, seen
        assert placed["vLLM API server"] and not set(placed["engine core"]) & set(placed["vLLM API server"]), seen
        assert rows[0]["cores_by_group"]["engine core"] > 0
    assert doc["results"]["ours"][0]["cores_by_group"]["gateway replica"] > 0  # ours went through the gateway
    table = (out / "bench.md").read_text()
    assert "| ours | 4 |" in table and "| bare | 4 |" in table and "Cores used per group" in table
    assert (out / "bench.png").stat().st_size > 10_000
