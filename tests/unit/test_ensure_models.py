"""``ensure_models``: what ``serving up`` trains before it starts anything."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from serving.config import parse_config
from serving.control import build as build_mod
from serving.control import stack as stack_mod


def test_a_path_version_naming_a_recipes_checkpoint_waits_for_that_recipe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``alias`` is listed before ``sub``, whose recipe builds the folder ``alias`` serves: the
    recipe runs first (once), then the alias finds its checkpoint."""
    calc = tmp_path / "calc" / "v1"
    calc.mkdir(parents=True)
    hf = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 4, "num_key_value_heads": 4}
    (calc / "config.json").write_text(json.dumps(hf | {"num_hidden_layers": 2, "hidden_size": 128}))
    recipe = {"base": "calc@v1", "data": "builtin:sub", "method": "lora", "steps": 1}
    alias = {"version": "v1", "path": str(tmp_path / "sub" / "v1")}
    cfg = parse_config(
        {
            "name": "t",
            "auth": {"mode": "open"},
            "checkpoint_root": str(tmp_path),
            "models": [
                {"name": "calc", "versions": [{"version": "v1"}]},
                {"name": "alias", "base": "calc", "versions": [alias]},
                {"name": "sub", "base": "calc", "versions": [{"version": "v1", "recipe": recipe}]},
            ],
        }
    )
    jobs: list[list[str]] = []

    def train(cmd: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        jobs.append(cmd)
        out = Path(cmd[cmd.index("--root") + 1]) / cmd[cmd.index("--model") + 1] / cmd[cmd.index("--version") + 1]
        out.mkdir(parents=True)
        (out / "adapter_config.json").write_text("{}")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(build_mod.subprocess, "run", train)
    build_mod.ensure_models(cfg, tmp_path, log=lambda _: None)
    assert [cmd[cmd.index("--model") + 1] for cmd in jobs] == ["sub"]


def _two_recipes(tmp_path: Path, default_model: str = "first") -> Any:
    recipe = {"base": "init:llama-tiny", "data": "builtin:add", "steps": 1}
    return parse_config(
        {
            "name": "t",
            "auth": {"mode": "open"},
            "checkpoint_root": str(tmp_path),
            "gateway": {"default_model": default_model},
            "models": [
                {"name": name, "versions": [{"version": "v1", "recipe": recipe}]} for name in ("first", "second")
            ],
        }
    )


def _fake_stack(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Training jobs that write a checkpoint, and a Ray head and Serve that only note what they get."""
    events: list[str] = []
    hf = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 4, "num_key_value_heads": 4}

    def train(cmd: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        model = cmd[cmd.index("--model") + 1]
        out = Path(cmd[cmd.index("--root") + 1]) / model / cmd[cmd.index("--version") + 1]
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps(hf | {"num_hidden_layers": 2, "hidden_size": 128}))
        events.append(f"train {model}")
        return subprocess.CompletedProcess(cmd, 0)

    def serve_config(cfg: Any, *_: Any, seed: Any = None, **__: Any) -> dict[str, Any]:
        assert seed is None or [m.name for m in seed.models] == [m.name for m in cfg.models]
        return {"applications": [{"name": m.name} for m in cfg.models]}

    monkeypatch.setattr(build_mod.subprocess, "run", train)
    state = stack_mod.StackState("t", 1, 1, 1, "/nonexistent", "http://127.0.0.1:1")
    monkeypatch.setattr(stack_mod, "start_ray", lambda *a, **k: events.append("ray") or state)
    monkeypatch.setattr(stack_mod, "build_serve_config", serve_config)
    monkeypatch.setattr(
        stack_mod, "deploy", lambda _, c: events.append("deploy " + ",".join(a["name"] for a in c["applications"]))
    )
    monkeypatch.setattr(stack_mod, "wait_running", lambda *a, **k: events.append("wait"))
    monkeypatch.setattr(stack_mod, "wait_http", lambda *_: None)
    return events


def _up(cfg: Any, tmp_path: Path, early: bool = True) -> None:
    stack_mod.up(cfg, tmp_path, {}, 10, log=lambda _: None, seed=cfg, early=early)


def test_the_first_model_built_is_deployed_while_the_second_trains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = _fake_stack(monkeypatch)
    _up(_two_recipes(tmp_path), tmp_path)
    assert events == ["train first", "ray", "deploy first", "train second", "deploy first,second", "wait"]


def test_nothing_is_deployed_early_where_the_built_models_alone_are_no_valid_stack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gateway's default model is the one still training: the first waits for it."""
    events = _fake_stack(monkeypatch)
    _up(_two_recipes(tmp_path, default_model="second"), tmp_path)
    assert events == ["train first", "train second", "ray", "deploy first,second", "wait"]


def test_early_off_deploys_once_after_every_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events = _fake_stack(monkeypatch)
    _up(_two_recipes(tmp_path), tmp_path, early=False)
    assert events == ["train first", "train second", "ray", "deploy first,second", "wait"]
