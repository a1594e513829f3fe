"""`serving promote`, `serving promotions` and the live record through the CLI, with the
controller's decisions run in-process between the commands (tests/unit/test_controller.py's fakes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from serving.control.cli import app
from tests.unit.test_controller import Clock, Cluster, _cfg, _controller, _publish


@pytest.fixture
def stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    from serving.control import stack

    monkeypatch.setattr(stack, "RUN_DIR", tmp_path / ".run")
    (tmp_path / "ck").mkdir()
    data = _cfg(mode="manual") | {"checkpoint_root": str(tmp_path / "ck")}
    config = tmp_path / "stack.yaml"
    config.write_text(yaml.safe_dump(data))
    return tmp_path, config


def _run(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def test_promote_submits_and_promotions_shows_each_step_and_reason(stack: tuple[Path, Path]) -> None:
    tmp, config = stack
    _publish(tmp / "ck", "calc", "v2", score=0.95)
    r = _run("promote", "calc", "v2", "-c", str(config), "--steps", "50,100", "--no-follow")
    assert r.exit_code == 0, r.output
    assert "no promotion controller holds the store lock" in r.output  # none ran yet
    (queued,) = (tmp / "ck" / ".control" / "t" / "requests" / "calc").iterdir()
    request = json.loads(queued.read_text())
    assert request["action"] == "promote" and request["overrides"] == {"steps": [50, 100]}
    clock, cluster = Clock(), None
    cluster = Cluster(clock)
    cluster.score = 0.3  # answers worse than its manifest claims
    ctl = _controller(tmp, _cfg(mode="manual") | {"checkpoint_root": str(tmp / "ck")}, clock, cluster)
    for _ in range(10):
        ctl.tick()
        clock.t += 2
    out = _run("promotions", "calc", "-c", str(config)).output
    assert "calc@v2 (from v1, manual) rolled_back" in out
    assert "reason: at 50%: online eval: exact_match 0.300 on 20 held-out prompts vs manifest 0.950" in out
    assert "step      v1=50% v2=50%" in out and "online_score=0.3" in out
    # the live record is what `serving render` (and `serving up`) deploy
    rendered = yaml.safe_load(_run("render", "-c", str(config)).stdout)
    assert [a["name"] for a in rendered["applications"]][:3] == ["gateway", "calc--v1", "other--v1"]


def test_promote_needs_a_version_or_abort(stack: tuple[Path, Path]) -> None:
    _, config = stack
    r = _run("promote", "calc", "-c", str(config))
    assert r.exit_code == 2 and "--abort" in r.output
    r = _run("promote", "calc", "--abort", "-c", str(config), "--no-follow")
    assert r.exit_code == 0


def test_the_old_routes_file_becomes_the_record(stack: tuple[Path, Path]) -> None:
    tmp, config = stack
    (tmp / ".run").mkdir()
    (tmp / ".run" / "t.versions.json").write_text(json.dumps({"calc": [{"version": "v2", "weight": 100}]}))
    rendered = yaml.safe_load(_run("render", "-c", str(config)).stdout)
    assert "calc--v2" in [a["name"] for a in rendered["applications"]]
    live = json.loads((tmp / "ck" / ".control" / "t" / "live.json").read_text())
    assert live["models"]["calc"] == [{"version": "v2", "weight": 100}]


@pytest.mark.parametrize("command", [["promote", "nope", "v2"], ["rollback", "nope"], ["versions", "nope"]])
def test_a_model_the_config_does_not_name_is_a_clear_exit_2(stack: tuple[Path, Path], command: list[str]) -> None:
    _, config = stack
    r = _run(*command, "-c", str(config))
    assert r.exit_code == 2, r.output
    assert "model 'nope' is not in" in r.output and "calc" in r.output, r.output
    assert "Traceback" not in r.output and isinstance(r.exception, SystemExit)


@pytest.mark.parametrize(
    ("steps", "why"), [("10,50", "invalid promotion settings: steps: Value error"), ("10,half", "invalid literal")]
)
def test_promote_with_invalid_settings_exits_2_before_submitting(
    stack: tuple[Path, Path], steps: str, why: str
) -> None:
    tmp, config = stack
    r = _run("promote", "calc", "v2", "-c", str(config), "--steps", steps, "--no-follow")
    assert r.exit_code == 2 and why in r.output, r.output
    assert not (tmp / "ck" / ".control" / "t" / "requests" / "calc.json").exists()


def test_rollback_to_a_version_that_is_not_deployed_exits_2_before_submitting(stack: tuple[Path, Path]) -> None:
    tmp, config = stack
    r = _run("rollback", "calc", "--to", "v9", "-c", str(config))
    assert r.exit_code == 2 and "calc@v9 is not deployed (calc serves v1)" in r.output, r.output
    assert not (tmp / "ck" / ".control" / "t" / "requests" / "calc.json").exists()
