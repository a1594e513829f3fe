"""The training job's checks before any Ray work: arguments, methods, existing versions, default
hyperparameters; and how eval counters become manifest metrics."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from serving.registry import BaseRef
from training.bases import ResolvedBase
from training.evaluate import metrics_from_sums
from training.lora import LoraOptions
from training.train import TrainingError, default_hyperparameters, main, train


def test_lora_needs_a_store_base_and_bad_arguments_fail_early(tmp_path: Path) -> None:
    with pytest.raises(TrainingError, match="needs a base from the checkpoint store"):
        train("m", "v1", str(tmp_path), "init:llama-tiny", "builtin:add", method="lora")
    with pytest.raises(ValueError, match="rank >= 1"):
        LoraOptions.from_args(0, 16, "q_proj")
    with pytest.raises(ValueError, match="target module"):
        LoraOptions.from_args(8, 16, " , ")
    with pytest.raises(TrainingError, match="unknown method"):
        train("m", "v1", str(tmp_path), "init:llama-tiny", "builtin:add", method="qlora")
    with pytest.raises(TrainingError, match=">= 1"):
        train("m", "v1", str(tmp_path), "init:llama-tiny", "builtin:add", steps=0)
    with pytest.raises(ValueError, match="invalid model name"):
        train("../m", "v1", str(tmp_path), "init:llama-tiny", "builtin:add")
    (tmp_path / "m" / "v1").mkdir(parents=True)
    with pytest.raises(TrainingError, match="already exists"):
        train("m", "v1", str(tmp_path), "init:llama-tiny", "builtin:add")


def test_cli_reports_errors_without_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--model", "m", "--version", "v1", "--base", "init:llama-tiny", "--data", "builtin:add"]
    assert main([*args, "--root", str(tmp_path), "--method", "lora"]) == 2
    assert "needs a base from the checkpoint store" in capsys.readouterr().err
    assert main([*args, "--root", str(tmp_path), "--data", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_default_hyperparameters(tmp_path: Path) -> None:
    scratch = default_hyperparameters(ResolvedBase(str(tmp_path), BaseRef(source="init", ref="init:llama-tiny")), 100)
    tuned = default_hyperparameters(ResolvedBase(str(tmp_path), BaseRef(source="folder", ref="x")), 100)
    # an empty folder counts as a tiny (<10M parameter) base: the project's own, fine-tuned fast
    assert scratch["lr"] >= tuned["lr"] and tuned["steps"] == 20  # three passes, at least 20 steps
    with open(tmp_path / "model.safetensors", "wb") as fh:
        fh.truncate(400_000_004)  # a sparse file: the size of ~100M float32 parameters
    big = default_hyperparameters(ResolvedBase(str(tmp_path), BaseRef(source="hub", ref="x")), 10_000)
    assert big["lr"] < tuned["lr"] and big["steps"] == 1875
    store_base = ResolvedBase(str(tmp_path), BaseRef(source="store", ref="m@v1"))
    adapter = default_hyperparameters(store_base, 10_000, lora=True)
    assert adapter["lr"] > big["lr"] and adapter["steps"] == big["steps"]  # an adapter takes a larger step


def test_metrics_from_sums() -> None:
    sums = {"hits": 3.0, "n": 4.0, "loss_sum": 8.0, "tokens": 4.0, "hits/a": 1.0, "n/a": 2.0, "hits/b": 2.0}
    sums["n/b"] = 2.0
    metrics = metrics_from_sums(sums)
    assert metrics == {
        "exact_match": 0.75,
        "exact_match/a": 0.5,
        "exact_match/b": 1.0,
        "mean_token_loss": 2.0,
        "perplexity": pytest.approx(math.e**2),
    }


@pytest.mark.parametrize("warmup", [0.0, 0.05, 0.1])
def test_short_runs_get_a_schedule_that_steps(warmup: float) -> None:
    """``--steps 10`` with the default 10% warm-up once crashed inside OneCycleLR (its warm-up was
    one step long); every length from 1 step on runs its whole schedule."""
    import torch

    from training.loop import warmup_fraction

    for steps in range(1, 60):
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=1e-3, total_steps=steps, pct_start=warmup_fraction(warmup, steps), anneal_strategy="cos"
        )
        for _ in range(steps - 1):
            optimizer.step()
            scheduler.step()
        assert scheduler.get_last_lr()[0] < 1e-3 or steps <= 2
