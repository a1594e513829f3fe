"""The training job end to end on a user's data: real Ray Train (2 DDP workers on CPU), real vLLM.

One short fine-tune of an existing Hugging Face folder on user-style JSONL (chat rows, raw
prompt/completion rows, an extra ``kind`` key): the CLI run is SIGKILLed after its first
checkpoints, nothing may look published, a rerun with other arguments is refused, and the same
command through the Python API resumes from a step > 0 and publishes. The manifest must record the
base, the run, both data files and the eval metrics; vLLM must load the published folder and,
fed the evaluated prompts, score what the job scored.

The base is the default ``adder@v1`` when ``serving up`` built it earlier in the run
(``checkpoints/adder/v1``), otherwise a freshly initialised tiny Llama folder (built in a second).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from serving.registry import CheckpointStore
from tests.support.sockets import is_loopback, listening, process_tree
from training.train import TrainingError, train

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
STEPS = 40


def _rows(split: str, n_plain: int, n_completion: int) -> list[dict[str, object]]:
    from training.datasets import generate

    return generate("max", seed=0, split=split, rows={"plain": n_plain, "completion": n_completion})


def _write(path: Path, rows: list[dict[str, object]]) -> str:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    built = ROOT / "checkpoints" / "adder" / "v1"
    if (built / "manifest.json").exists():
        return str(built)
    from training.families import build_base

    corpus = _rows("train", 200, 100)
    return str(build_base(tmp_path_factory.mktemp("base") / "tiny", "init:llama-tiny", corpus, seed=0))


def _vllm_eval(root: Path, model: str, version: str, eval_file: str) -> dict[str, float]:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "training.vllm_eval", "--root", str(root), "--model", model]
    cmd += ["--version", version, "--eval", eval_file, "--n", "1000"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(next(line for line in reversed(out.stdout.splitlines()) if line.startswith("{")))


def _kill_after_checkpoint(args: list[str]) -> tuple[list[str], list[tuple[str, str, int]]]:
    """The CLI run's output until its step-20 checkpoint, and the ports its processes listened on
    then; the run is SIGKILLed there."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "training.train", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    seen: list[str] = []
    sockets: list[tuple[str, str, int]] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            m = re.search(rf"\] step (\d+)/{STEPS} ", line)
            if m and int(m[1]) >= 24:  # the step-10 and step-20 checkpoints are reported by now
                sockets = listening(process_tree(proc.pid))
                break
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver, its Ray head and raylet
        proc.wait(timeout=60)
    return seen, sockets


def test_fine_tune_user_jsonl_resumes_after_kill_and_vllm_serves_it(tmp_path: Path, base_dir: str) -> None:
    root = tmp_path / "store"
    data = _write(tmp_path / "train.jsonl", _rows("train", 300, 100))
    evals = _write(tmp_path / "eval.jsonl", _rows("eval", 24, 16))
    args = ["--model", "maxer", "--version", "v1", "--base", base_dir, "--data", data, "--eval", evals]
    args += ["--root", str(root), "--steps", str(STEPS), "--checkpoint-every", "10"]
    seen, sockets = _kill_after_checkpoint(args)
    assert any(re.search(rf"step \d+/{STEPS}", line) for line in seen), "".join(seen[-40:])
    # the job's own Ray on loopback (LOCAL_RAY_LOOPBACK); only rank 0's DDP rendezvous store (torch's
    # TCPStore, no address option) listens on every interface
    assert any("gcs_server" in cmd for cmd, _, _ in sockets), sockets
    open_ = [(cmd[:60], ip, port) for cmd, ip, port in sockets if not is_loopback(ip)]
    assert len(open_) <= 1 and all(cmd.startswith("ray::RayTrainWorker") for cmd, _, _ in open_), open_
    assert not any("Reporting training result" in line for line in seen), "Ray Train chatter is back"
    # the job's own Ray runs with the job's private token: Ray's default token would warn
    assert not any("Token authentication is enabled for this Ray cluster" in line for line in seen), "".join(seen)
    assert not any("PreemptionWatcher" in line for line in seen), "".join(seen)  # no watcher on its own Ray

    store = CheckpointStore(str(root))
    assert store.list_versions("maxer") == [] and not store.exists("maxer", "v1")
    assert (root / "maxer" / ".runs" / "v1" / "job.json").is_file()
    with pytest.raises(TrainingError, match="other arguments"):
        train("maxer", "v1", str(root), base_dir, data, evals, steps=STEPS + 10, checkpoint_every=10)

    publish_dirs = set(Path(tempfile.gettempdir()).glob("publish-*"))
    # resumed as a user runs it: a process of its own (this one imported Ray already, and the job
    # starts its private, token-authenticated Ray only in a process that has not)
    subprocess.run([sys.executable, "-m", "training.train", *args], cwd=ROOT, check=True, timeout=600)
    manifest = store.manifest("maxer", "v1").model_dump(mode="json")
    assert set(Path(tempfile.gettempdir()).glob("publish-*")) == publish_dirs  # its folder went with it
    run, ev = manifest["training"], manifest["eval"]
    assert run["resumed_from_step"] >= 10 and run["steps"] == STEPS and run["method"] == "full"
    assert run["workers"] == 2 and run["final_loss"] > 0
    assert run["data"] == {
        "uri": data,
        "sha256": hashlib.sha256(Path(data).read_bytes()).hexdigest(),
        "rows": 400,
        "format": "mixed",
    }
    assert manifest["base"] == {"source": "folder", "ref": str(Path(base_dir).resolve()), "manifest_sha256": None}
    assert ev["n"] == 40 and ev["data"]["uri"] == evals and ev["data"]["rows"] == 40
    assert {"exact_match", "exact_match/plain", "exact_match/completion", "mean_token_loss", "perplexity"} <= set(
        ev["metrics"]
    )
    assert manifest["architecture"] == json.loads((Path(base_dir) / "config.json").read_text())["architectures"][0]
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(manifest["files"])
    # the tokenizer is the base's, byte for byte
    assert (root / "maxer" / "v1" / "tokenizer.json").read_bytes() == (Path(base_dir) / "tokenizer.json").read_bytes()
    store.verify("maxer", "v1")
    assert sorted(p.name for p in (root / "maxer").iterdir()) == ["v1"]  # no .tmp-*, no .runs
    with pytest.raises(TrainingError, match="already exists"):
        train("maxer", "v1", str(root), base_dir, data, evals)

    result = _vllm_eval(root, "maxer", "v1", evals)
    print(f"manifest: {json.dumps(ev['metrics'])}\nvLLM: {json.dumps(result)}")
    assert result["n"] == 40 and result["chat_n"] == 24
    assert abs(result["generate_exact_match"] - ev["metrics"]["exact_match"]) <= 0.05


def test_the_jobs_own_ray_needs_its_token() -> None:
    """A job that starts its own Ray (no RAY_ADDRESS) runs it with Ray's token authentication, a
    token only that process's environment holds (no file, so a killed job leaves none behind), and
    no dashboard or job API; a client without the token is refused; the environment is put back
    after."""
    probe = """
import os
from training.ray_runtime import init_ray
stop = init_ray(1, None)
import ray
import subprocess, sys
node = ray._private.worker.global_worker.node
web = node.address_info.get("webui_url")
print(os.environ["RAY_AUTH_MODE"], len(os.environ["RAY_AUTH_TOKEN"]), os.environ.get("RAY_AUTH_TOKEN_PATH"), web,
      os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"])
# another process of this user, without the token: Ray refuses it (2 tries, not Ray's 20, 1 s apart)
env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_TOKEN"} | {"RAY_gcs_server_port_wait_time_s": "2"}
probe = f"import ray; ray.init(address={node.address!r}); print('connected')"
other = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=60)
print("without token", other.returncode != 0 and "connected" not in other.stdout)
stop()
print("after", os.environ.get("RAY_AUTH_MODE"), os.environ.get("RAY_AUTH_TOKEN"), os.environ.get("RAY_AUTH_TOKEN_PATH"),
      os.environ.get("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"), os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"))
"""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    env["RAY_AUTH_TOKEN_PATH"] = "/nonexistent/token"  # a stack's token path in the caller's environment is set aside
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=180)
    lines = out.stdout.split("\n")
    assert lines[0] in ("token 64 None None 0.5", "token 64 None  0.5"), out.stdout + out.stderr
    assert lines[1] == "without token True", out.stdout + out.stderr
    assert lines[2] == "after None None /nonexistent/token None None", out.stdout + out.stderr
