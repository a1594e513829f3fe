"""The training job end to end: real Ray Train (2 DDP workers on CPU), real vLLM on the result.

* ``test_tiny_add_is_published_and_vllm_answers`` trains the tiny model with its default steps
  (about 2 minutes on 2 cores), checks the manifest and the store's integrity, then loads the
  published directory in vLLM (subprocess: vLLM spawns processes) and requires >= 0.9 exact match
  through both ``generate()`` on raw prompts and ``chat()``.
* ``test_killed_job_resumes_and_publishes_atomically`` SIGKILLs a short run after its second
  checkpoint, checks that nothing looks published, reruns the same command and requires that it
  resumed from a step > 0; then trains a child version from it (``parent``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from serving.registry import CheckpointStore
from training.train import TrainingError, train

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def _vllm_eval(root: Path, model: str, version: str, n: int = 200) -> dict[str, object]:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "training.vllm_eval", "--root", str(root)]
    cmd += ["--model", model, "--version", version, "--n", str(n)]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    line = next(line for line in reversed(out.stdout.splitlines()) if line.startswith("{"))
    return json.loads(line)


def test_tiny_add_is_published_and_vllm_answers(tmp_path: Path) -> None:
    root = tmp_path / "store"
    built = ROOT / "checkpoints" / "adder" / "v1"
    t0 = time.monotonic()
    if (built / "manifest.json").exists():
        # Built by this same job for the integration stack earlier in the run (`serving up`
        # trains it from its recipe): check that one instead of spending minutes training again.
        shutil.copytree(built, root / "adder" / "v1")
        manifest = json.loads((root / "adder" / "v1" / "manifest.json").read_text())
    else:
        manifest = train("adder", "v1", "add", str(root), size="tiny", workers=2)
    print(f"trained in {time.monotonic() - t0:.0f}s: {json.dumps(manifest['eval'])}")

    assert manifest["model"] == "adder" and manifest["version"] == "v1"
    assert manifest["task"] == "add" and manifest["size"] == "tiny"
    assert manifest["steps"] == 1200 and manifest["parent_version"] is None
    assert manifest["eval"]["n"] == 500 and manifest["eval"]["exact_match"] >= 0.9
    assert manifest["final_loss"] < 0.2
    assert manifest["resumed_from_step"] == 0
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(manifest["files"])
    store = CheckpointStore(str(root))
    assert store.list_models() == ["adder"] and store.list_versions("adder") == ["v1"]
    assert store.verify("adder", "v1", min_exact_match=0.9).eval.exact_match == pytest.approx(
        manifest["eval"]["exact_match"]
    )
    assert sorted(p.name for p in (root / "adder").iterdir()) == ["v1"]  # no .tmp-*, no .runs/v1
    config = json.loads((root / "adder" / "v1" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"

    with pytest.raises(TrainingError, match="already exists"):
        train("adder", "v1", "add", str(root))

    result = _vllm_eval(root, "adder", "v1")
    print(f"vLLM: {json.dumps(result)}")
    assert result["generate_exact_match"] >= 0.9
    assert result["chat_exact_match"] >= 0.9
    score = manifest["eval"]["exact_match"]
    assert abs(result["generate_exact_match"] - score) <= 0.05
    assert abs(result["chat_exact_match"] - result["generate_exact_match"]) <= 0.01


def test_killed_job_resumes_and_publishes_atomically(tmp_path: Path) -> None:
    root = tmp_path / "store"
    args = ["--model", "adder", "--version", "r1", "--task", "add", "--root", str(root)]
    args += ["--steps", "60", "--checkpoint-every", "20"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "training.train", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    seen: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            if "[adder@r1] step 40/60" in line:  # the step-20 checkpoint is reported by now
                break
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver, its Ray head and raylet
        proc.wait(timeout=60)
    assert any("step 40/60" in line for line in seen), "".join(seen[-40:])

    store = CheckpointStore(str(root))
    assert store.list_versions("adder") == []
    assert not store.exists("adder", "r1")
    assert (root / "adder" / ".runs" / "r1" / "job.json").is_file()

    with pytest.raises(TrainingError, match="other arguments"):
        train("adder", "r1", "add", str(root), steps=80, checkpoint_every=20)

    manifest = train("adder", "r1", "add", str(root), steps=60, checkpoint_every=20)
    assert manifest["resumed_from_step"] > 0
    assert manifest["steps"] == 60
    store.verify("adder", "r1")
    assert not (root / "adder" / ".runs" / "r1").exists()

    with pytest.raises(TrainingError, match="differs from parent"):
        train("adder", "r2", "add", str(root), size="small", parent="r1")
    child = train("adder", "r2", "sub", str(root), size=None, steps=20, parent="r1")
    assert child["parent_version"] == "r1" and child["size"] == "tiny" and child["task"] == "sub"
    assert store.list_versions("adder") == ["r1", "r2"]
