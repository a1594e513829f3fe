"""`serving promote`, `serving promotions` and the live record through the CLI, with the
controller's decisions run in-process between the commands (tests/unit/test_controller.py's fakes);
and what the CLI says of a store, config or output file it cannot read or write."""

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


# --- a store or file that cannot be read: a message and exit 2, never a traceback ----------------


def test_down_and_status_do_not_read_the_store(stack: tuple[Path, Path]) -> None:
    tmp, config = stack
    (tmp / "ck" / ".control" / "t").mkdir(parents=True)
    (tmp / "ck" / ".control" / "t" / "live.json").write_text("{not json")
    r = _run("down", "-c", str(config))
    assert r.exit_code == 0 and "no running stack 't'" in r.output, r.output
    r = _run("status", "-c", str(config))
    assert r.exit_code == 1 and "no running stack 't'" in r.output, r.output
    assert isinstance(r.exception, SystemExit)


@pytest.mark.parametrize(
    ("live", "why"),
    [
        (b"{not json", "JSONDecodeError"),
        (b"\x80\x81", "UnicodeDecodeError"),
        (b"[]", "is not"),
        (b'{"modelz": {}}', "is not"),
        (b'{"models": {"calc": {"version": "v1"}}}', "is not"),
        (b'{"models": {"calc": [{"version": 5, "weight": "all"}]}}', "ValidationError"),
        (None, "IsADirectoryError"),
    ],
)
def test_an_unreadable_promotion_record_is_a_clean_exit_2(
    stack: tuple[Path, Path], live: bytes | None, why: str
) -> None:
    tmp, config = stack
    record = tmp / "ck" / ".control" / "t" / "live.json"
    record.parent.mkdir(parents=True)
    record.mkdir() if live is None else record.write_bytes(live)
    for command in ("render", "validate", "versions calc", "rollback calc"):
        r = _run(*command.split(), "-c", str(config))
        assert r.exit_code == 2, (command, r.output)
        assert f"cannot read the promotion record in the checkpoint store {tmp / 'ck'}" in r.output, r.output
        assert why in r.output and isinstance(r.exception, SystemExit), r.output


def test_render_into_a_missing_folder_is_a_clean_exit_2(stack: tuple[Path, Path]) -> None:
    tmp, config = stack
    r = _run("render", "-c", str(config), "-o", str(tmp / "nope" / "x.yaml"))
    assert r.exit_code == 2 and f"cannot write {tmp / 'nope' / 'x.yaml'}" in r.output, r.output
    assert isinstance(r.exception, SystemExit)


def test_a_config_that_is_a_folder_or_not_utf8_is_a_clean_exit_2(tmp_path: Path) -> None:
    latin1 = tmp_path / "stack.yaml"
    latin1.write_bytes("name: caf\xe9\n".encode("latin-1"))
    for path, why in ((tmp_path, "is a directory"), (latin1, "not UTF-8 text")):
        r = _run("validate", "-c", str(path))
        assert r.exit_code == 2 and f"{path}: {why}" in r.output, r.output
        assert isinstance(r.exception, SystemExit)


def test_keys_hash_strips_the_key_as_the_gateway_does(monkeypatch: pytest.MonkeyPatch) -> None:
    from serving.config import AuthConfig
    from serving.gateway.admission.auth import Authenticator

    monkeypatch.setenv("RAYSTACK_TEST_KEY", "  sk-from-a-file\n")  # a Secret made from a file
    r = _run("keys", "hash", "--from-env", "RAYSTACK_TEST_KEY")
    assert r.exit_code == 0, r.output
    auth = AuthConfig.model_validate({"tenants": [{"name": "t", "key_hashes": [r.stdout.strip()]}]})
    assert Authenticator(auth).authenticate("Bearer sk-from-a-file").name == "t"
    monkeypatch.setenv("RAYSTACK_TEST_KEY", " \n")
    r = _run("keys", "hash", "--from-env", "RAYSTACK_TEST_KEY")
    assert r.exit_code == 2 and "RAYSTACK_TEST_KEY is not set or empty" in r.output, r.output
