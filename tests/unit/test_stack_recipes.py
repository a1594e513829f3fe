"""``serving up``'s log line for a recipe it builds names the base and data without credentials,
and the job it starts gets them in an argument file, not on its command line."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from serving.config import parse_config
from serving.control import build as build_mod
from training.train import parser


def test_a_recipes_uris_are_logged_without_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recipe = {
        "base": "https://user:s3cr3t@models.example/llama",
        "data": "s3://bucket/train.jsonl?X-Amz-Credential=AKIA&X-Amz-Signature=sig123",
        "steps": 1,
    }
    cfg = parse_config(
        {
            "name": "t",
            "auth": {"mode": "open"},
            "checkpoint_root": str(tmp_path),
            "models": [{"name": "m", "versions": [{"version": "v1", "recipe": recipe}]}],
        }
    )
    hf = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 4, "num_key_value_heads": 4}

    jobs: list[tuple[list[str], Any]] = []

    def train(cmd: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        argfile = Path(cmd[-1][1:])
        jobs.append((cmd, argfile.stat().st_mode & 0o777, parser().parse_args(cmd[3:])))
        out = tmp_path / "m" / "v1"
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps(hf | {"num_hidden_layers": 2, "hidden_size": 128}))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(build_mod.subprocess, "run", train)
    lines: list[str] = []
    build_mod.ensure_models(cfg, tmp_path, log=lines.append)
    assert lines == [
        "building m@v1 from https://models.example/llama on s3://bucket/train.jsonl?<redacted> with the training job..."
    ]
    ((cmd, mode, args),) = jobs
    assert not any("s3cr3t" in a or "X-Amz" in a for a in cmd) and cmd[-1].startswith("@") and mode == 0o600
    assert (args.base, args.data, args.eval, args.model, args.steps) == (recipe["base"], recipe["data"], None, "m", 1)
    assert not Path(cmd[-1][1:]).exists()
