"""``ensure_models``: what ``serving up`` trains before it starts anything."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from serving.config import parse_config
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

    monkeypatch.setattr(stack_mod.subprocess, "run", train)
    stack_mod.ensure_models(cfg, tmp_path, log=lambda _: None)
    assert [cmd[cmd.index("--model") + 1] for cmd in jobs] == ["sub"]
