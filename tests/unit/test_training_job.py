"""The training job's checks before any Ray work: arguments, methods, existing versions, LoRA
targets, default hyperparameters from the base's size; what it does with a run that diverged or
failed; and how eval counters become manifest metrics (``_fit``, the Ray part, is replaced)."""

from __future__ import annotations

import json
import math
import struct
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from serving.manifest import BaseRef, Evaluation, Manifest
from serving.registry import BelowEvalGate, CheckpointStore, Gate
from training.arguments import default_hyperparameters, hyperparameters
from training.bases import ResolvedBase
from training.evaluate import metrics_from_sums
from training.lora import LoraOptions, check_targets
from training.train import TrainingError, failure_message, main, train

ROWS = [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(20)]
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 300,
}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache for the module: the ``init:`` base is built once."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def job(tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A store root and a data file under tmp, and the module's cache as the job's."""
    monkeypatch.setattr("training.train.CACHE_DIR", cache_dir)
    data = tmp_path / "t.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return {"root": tmp_path / "store", "data": str(data)}


def _safetensors(path: Path, params: int, dtype: str = "F32") -> None:
    """A sparse safetensors file: a real header for one tensor of ``params`` elements, no data."""
    width = {"F32": 4, "BF16": 2}[dtype]
    header = json.dumps({"w": {"dtype": dtype, "shape": [params], "data_offsets": [0, params * width]}}).encode()
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(header)) + header)
        fh.truncate(8 + len(header) + params * width)


def _base(directory: Path, source: str = "hub") -> ResolvedBase:
    return ResolvedBase(str(directory), BaseRef(source=source, ref="x"))  # type: ignore[arg-type]


def _no_fit(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("the job got as far as Ray")


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
    scratch = default_hyperparameters(_base(tmp_path, "init"), 100)
    (tmp_path / "tiny").mkdir()
    _safetensors(tmp_path / "tiny" / "model.safetensors", 1_000_000)
    # a tiny (<10M parameter) base: the project's own, fine-tuned fast
    tuned = default_hyperparameters(_base(tmp_path / "tiny", "folder"), 100)
    assert scratch["lr"] >= tuned["lr"] == 3e-3 and tuned["steps"] == 20  # three passes, at least 20 steps
    _safetensors(tmp_path / "model.safetensors", 100_000_001)  # sparse: no data written
    big = default_hyperparameters(_base(tmp_path), 10_000)
    assert big["lr"] < tuned["lr"] and big["steps"] == 1875
    adapter = default_hyperparameters(_base(tmp_path, "store"), 10_000, lora=True)
    assert adapter["lr"] > big["lr"] and adapter["steps"] == big["steps"]  # an adapter takes a larger step


def test_base_size_is_read_from_headers_or_pickled_weights(tmp_path: Path) -> None:
    """A bf16 safetensors base counts its parameters (not bytes / 4); a pickled base counts at all."""
    half = tmp_path / "bf16"
    half.mkdir()
    _safetensors(half / "model.safetensors", 150_000_000, "BF16")  # 300 MB: once counted as 75M
    assert default_hyperparameters(_base(half), 10_000)["lr"] == 2e-5
    pickled = tmp_path / "bin"
    pickled.mkdir()
    with open(pickled / "pytorch_model.bin", "wb") as fh:
        fh.truncate(28_000_000_000)  # sparse: a 14B-parameter fp16 base, once counted as 0
    assert default_hyperparameters(_base(pickled), 10_000)["lr"] <= 2e-5
    assert default_hyperparameters(_base(pickled, "store"), 10_000, lora=True)["lr"] == 2e-4
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "pytorch_model-00001-of-00002.bin").write_bytes(b"x")
    index = {"metadata": {"total_size": 140_000_000}, "weight_map": {}}  # 70M parameters at 2 bytes
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    assert default_hyperparameters(_base(sharded), 10_000)["lr"] == 1e-4
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "model.safetensors").write_bytes(b"\xff" * 16)  # not a header: the size is unknown
    for directory in (unknown, tmp_path / "sharded" / "nothing"):
        assert default_hyperparameters(_base(directory), 10_000)["lr"] == 2e-5  # the largest base's


@pytest.mark.parametrize("value", [math.nan, -math.inf])
def test_gate_refuses_a_metric_that_is_not_a_number(value: float) -> None:
    """``nan < min`` and ``nan > max`` are both false: a diverged run once passed any gate."""
    evaluation = Evaluation(metrics={"mean_token_loss": value, "exact_match": value}, n=10)
    manifest = Manifest(model="m", version="v1", files={}, created_at=datetime.now(UTC), eval=evaluation)
    for gate in (Gate(metric="mean_token_loss", max=2.0), Gate(metric="exact_match", min=0.5)):
        with pytest.raises(BelowEvalGate, match=f"m@v1: {gate.metric} is {value} .*not a finite number"):
            gate.check(manifest)


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--lr", "-1"), ("--lr", "nan"), ("--lr", "inf"), ("--lr", "0"), ("--threads", "-1")]
    + [("--batch-size", "0"), ("--batch-size", "1"), ("--workers", "0")],
)
def test_bad_hyperparameters_fail_before_anything_is_claimed(
    job: dict[str, Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    """A bad --lr, --threads or --batch-size once failed only in the Ray workers (or bent: a batch
    of 0 became a row a rank), after the run directory had been claimed."""
    monkeypatch.setattr("training.train._fit", _no_fit)
    args = ["--model", "m", "--version", "v1", "--base", "init:llama-tiny", "--data", job["data"]]
    assert main([*args, "--root", str(job["root"]), flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag} ") and err.count("\n") == 1
    assert not job["root"].exists()


@pytest.mark.parametrize(
    ("workers", "batch", "choices"), [("3", "16", "15 or 18"), ("2", "1", "2"), ("4", "6", "4 or 8")]
)
def test_a_batch_the_workers_cannot_split_evenly_is_refused(
    job: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    workers: str,
    batch: str,
    choices: str,
) -> None:
    """Each rank takes batch // workers rows: --batch-size 16 --workers 3 trained 15 rows a step
    while the manifest said 16."""
    monkeypatch.setattr("training.train._fit", _no_fit)
    args = ["--model", "m", "--version", "v1", "--base", "init:llama-tiny", "--data", job["data"]]
    assert main([*args, "--root", str(job["root"]), "--workers", workers, "--batch-size", batch]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: --batch-size {batch} is not a multiple of --workers {workers}: each rank trains the same "
        f"number of rows a step, so the batch must split evenly; pass --batch-size {choices}\n"
    )
    assert not job["root"].exists()


def test_a_default_batch_is_rounded_down_to_a_multiple_of_the_workers(tmp_path: Path) -> None:
    _safetensors(tmp_path / "model.safetensors", 100_000_001)  # a real base: 16 rows a step
    opts = {"lora": None, "steps": None, "batch_size": None, "lr": None}
    assert hyperparameters(_base(tmp_path), 1000, opts | {"workers": 3})["batch_size"] == 15
    assert hyperparameters(_base(tmp_path), 1000, opts | {"workers": 2})["batch_size"] == 16
    assert hyperparameters(_base(tmp_path, "init"), 1000, opts | {"workers": 2})["batch_size"] == 128
    assert hyperparameters(_base(tmp_path), 1000, opts | {"workers": 3, "batch_size": 18})["batch_size"] == 18
    with pytest.raises(TrainingError, match="the default batch size 16 is smaller than --workers 17"):
        hyperparameters(_base(tmp_path), 1000, opts | {"workers": 17})


def test_train_refuses_a_learning_rate_that_is_not_finite(job: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("training.train._fit", _no_fit)
    for lr in (math.inf, math.nan):
        with pytest.raises(TrainingError, match=f"--lr must be a finite number > 0, got {lr}"):
            train("m", "v1", str(job["root"]), "init:llama-tiny", job["data"], lr=lr)
    assert not job["root"].exists()


def test_lora_targets_are_checked_against_the_base(job: dict[str, Any], tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps(TINY_LLAMA))
    (base / "tokenizer.json").write_text("{}")
    CheckpointStore(str(job["root"])).publish(base, {"model": "b", "version": "v1"})
    check_targets(str(base), LoraOptions())  # the default projections are there
    for targets, message in [("q_proj,foo", r"'foo' matches no module"), ("mlp", r"LlamaMLP\), which LoRA cannot")]:
        options = LoraOptions.from_args(8, 16, targets)
        with pytest.raises(ValueError, match=f"--lora-targets for .*: .*{message}.*named .*down_proj.*q_proj"):
            train("m", "v1", str(job["root"]), "b@v1", job["data"], method="lora", lora=options)
    assert not (job["root"] / "m").exists()


def test_a_run_that_diverged_is_not_published(job: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    hf = job["root"].parent / "publish-x" / "hf"

    def fit(store: CheckpointStore, run: str, label: str, *args: Any) -> tuple[dict[str, Any], int]:
        hf.mkdir(parents=True)
        (hf / "config.json").write_text("{}")
        outcome = {"steps": 20, "final_loss": math.nan, "resumed_from_step": 0, "train_s": 1.0, "n": 1}
        return outcome | {"metrics": {"exact_match": 0.0, "mean_token_loss": math.inf}, "hf": str(hf)}, 2

    monkeypatch.setattr("training.train._fit", fit)
    store = CheckpointStore(str(job["root"]))
    expected = r"m@v1 is not published: final training loss nan, eval mean_token_loss inf .*kept for inspection"
    with pytest.raises(TrainingError, match=expected):
        train("m", "v1", str(job["root"]), "init:llama-tiny", job["data"], steps=20)
    assert not store.exists("m", "v1") and not hf.parent.exists()
    assert (job["root"] / "m" / ".runs" / "v1" / "job.json").is_file()


def _failing_fit(jobs: list[dict[str, Any]]) -> Any:
    """A ``_fit`` that notes each run's job.json and fails before its first checkpoint."""

    def fit(store: CheckpointStore, run: str, *args: Any) -> Any:
        jobs.append(json.loads(store.fs.cat_file(f"{run}/job.json")))
        raise TrainingError("the workers failed")

    return fit


def test_a_run_with_no_checkpoint_gives_way_to_other_arguments(
    job: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that failed before its first checkpoint holds nothing to resume: a corrected command
    replaces it. One with a checkpoint still resumes only with its own arguments."""
    jobs: list[dict[str, Any]] = []
    monkeypatch.setattr("training.train._fit", _failing_fit(jobs))
    root = str(job["root"])
    for lr in (1e-3, 5e-4):
        with pytest.raises(TrainingError, match="the workers failed"):
            train("m", "v1", root, "init:llama-tiny", job["data"], steps=20, lr=lr)
    assert [j["lr"] for j in jobs] == [1e-3, 5e-4]
    (job["root"] / "m" / ".runs" / "v1" / "checkpoint_000010").mkdir()
    with pytest.raises(TrainingError, match=r"with other arguments \(was, now\): \{'lr': \(0.0005, 0.0001\)\}"):
        train("m", "v1", root, "init:llama-tiny", job["data"], steps=20, lr=1e-4)


def test_a_run_resumes_only_with_the_same_workers(job: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks shape the trajectory (each draws its own share of a batch): a checkpoint of a run
    with 2 workers does not resume with 4."""
    jobs: list[dict[str, Any]] = []
    monkeypatch.setattr("training.train._fit", _failing_fit(jobs))
    root = str(job["root"])
    with pytest.raises(TrainingError, match="the workers failed"):
        train("m", "v1", root, "init:llama-tiny", job["data"], steps=20, batch_size=8, workers=2)
    assert jobs[0]["workers"] == 2 and jobs[0]["batch_size"] == 8
    (job["root"] / "m" / ".runs" / "v1" / "checkpoint_000010").mkdir()
    with pytest.raises(TrainingError, match=r"with other arguments \(was, now\): \{'workers': \(2, 4\)\}"):
        train("m", "v1", root, "init:llama-tiny", job["data"], steps=20, batch_size=8, workers=4)
    with pytest.raises(TrainingError, match="the workers failed"):  # the same arguments resume
        train("m", "v1", root, "init:llama-tiny", job["data"], steps=20, batch_size=8, workers=2)


def test_a_failed_ray_run_is_one_line_with_the_workers_exception() -> None:
    from ray.train.v2.api.exceptions import ControllerError, WorkerGroupError

    failures = {1: RuntimeError("later"), 0: ValueError("Target modules {'foo'} not found\nin the base model.")}
    exc = WorkerGroupError("Worker 0 failed:\nTraceback (most recent call last):\n ...", failures)
    assert failure_message("m@v1", exc) == (
        "m@v1: training failed on rank 0: ValueError: Target modules {'foo'} not found in the base model."
    )
    controller = ControllerError(OSError("no space left"))
    assert (
        failure_message("m@v1", controller)
        == "m@v1: training failed on the Ray Train controller: OSError: no space left"
    )


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


def test_the_loop_stops_on_a_loss_that_is_not_a_number() -> None:
    """The workers check the all-ranks mean before each checkpoint and at the end."""
    from training.loop import check_finite

    assert check_finite("m@v1", 200, 0.5) == 0.5
    for value in (math.nan, math.inf):
        with pytest.raises(
            FloatingPointError, match=rf"\[m@v1\] the training loss is {value} at step 200: the run diverged"
        ):
            check_finite("m@v1", 200, value)
