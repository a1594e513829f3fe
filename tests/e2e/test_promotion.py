"""The loop runs itself: the training job, submitted to the running stack as a Ray job, publishes
v2; the promotion controller (``promotion: auto``) canaries and promotes it under paced load with
no CLI call, survives being killed mid-canary, and rolls back a v3 whose manifest claims v2's
score but whose weights answer worse (online eval); a re-run of ``serving up`` keeps v2.

v1 of model ``arith`` is the default addition model, brought into this test's own store with
``serving import``. v2 is fine-tuned from ``arith@v1`` on a user-style JSONL file of a task the
base does not know (``max 37 45=`` -> ``45``, ``python -m training.datasets max``); through the
API its answers follow the new data at the manifest's score while v1's do not.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import ROOT, SERVING, Stack, running_stack

pytestmark = pytest.mark.e2e

PAIRS = [(a, b) for a in range(11, 99, 7) for b in range(3, 90, 13)][:60]
# exact match on max in runs by hand (2026-12-05): 0.98 at 100 steps (15 s of training), 0.99 at
# 150; the gate is 0.8
FINETUNE_STEPS = 100
POLICY = {
    "mode": "auto",
    "steps": [25, 100],
    "step_seconds": 8,
    "min_requests": 3,
    "warmup_requests": 2,
    "drain_seconds": 2,
    # 5x (default 2x): on 2 cores a just-started engine answered at 2.2x the live one's TTFT in a
    # CI run; this test is about the loop, the TTFT verdicts are in tests/unit
    "max_ttft_ratio": 5,
    "online_eval": {"samples": 12, "margin": 0.15},
}


def _config(tmp: Path) -> Path:
    data = {
        "name": "promotest",
        "checkpoint_root": str(tmp / "store"),
        "gateway": {"port": 8013, "proxy_port": 8113},
        "auth": {"mode": "open"},
        "local_ray": {"gcs_port": 6394, "dashboard_port": 8279, "metrics_export_port": 8089, "num_cpus": 8},
        "controller": {"poll_s": 1, "lock_ttl_s": 10},
        "models": [
            {
                "name": "arith",
                "gate": {"metric": "exact_match", "min": 0.8},
                "versions": [{"version": "v1"}],
                # -O0: no torch.compile at each version's engine start (tests/e2e/test_bench.py compiles)
                "engine": {
                    "max_model_len": 256,
                    "dtype": "float32",
                    "max_num_seqs": 32,
                    "extra_args": {"optimization-level": 0},
                },
                "promotion": POLICY,
            }
        ],
    }
    path = tmp / "promotest.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from training.datasets import write_dataset

    tmp = tmp_path_factory.mktemp("promotion")
    source = ROOT / "checkpoints" / "adder" / "v1"
    if not (source / "manifest.json").exists():  # built by `serving up` of the main stacks
        # a process of its own: the job's private Ray needs one that has not imported Ray yet
        job = ["--root", str(ROOT / "checkpoints"), "--model", "adder", "--version", "v1"]
        job += ["--base", "init:qwen3-tiny", "--data", "builtin:add"]
        subprocess.run([sys.executable, "-m", "training.train", *job], cwd=ROOT, check=True, timeout=1800)
    root = str(tmp / "store")
    imported = subprocess.run(
        [SERVING, "import", str(source), "--model", "arith", "--version", "v1", "--root", root],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert imported.returncode == 0, imported.stdout + imported.stderr
    write_dataset("max", tmp / "max-data")  # the user's JSONL
    return tmp


@pytest.fixture(scope="module")
def stack(store: Path) -> Iterator[Stack]:
    with running_stack(_config(store)) as s:
        yield s


def _answer(url: str, model: str, prompt: str) -> tuple[int, str]:
    r = httpx.post(
        f"{url}/v1/completions", timeout=120, json={"model": model, "prompt": prompt, "max_tokens": 5, "temperature": 0}
    )
    return r.status_code, (r.json()["choices"][0]["text"].strip() if r.status_code == 200 else r.text)


def _exact_max(url: str, model: str) -> float:
    return sum(_answer(url, model, f"max {a} {b}=") == (200, str(max(a, b))) for a, b in PAIRS) / len(PAIRS)


def _history(stack: Stack) -> list[dict[str, object]]:
    from serving.record import ControlStore

    control = ControlStore(str(stack.config.parent / "store"), "promotest")
    return [r.model_dump() for r in control.history("arith")]


def _wait_for(stack: Stack, version: str, statuses: set[str], timeout_s: float) -> dict[str, object]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        recs = [r for r in _history(stack) if r["version"] == version]
        if recs and recs[-1]["status"] in statuses:
            return recs[-1]
        time.sleep(1)
    raise AssertionError(f"arith@{version} never reached {statuses}: {_history(stack)[-1:]}")


def _submit_training(stack: Stack, store: Path) -> str:
    """The training job as a Ray job of the running stack (how the RayJob runs it on Kubernetes)."""
    from ray.job_submission import JobSubmissionClient

    from serving.control.stack import StackState

    state = StackState.load("promotest")
    assert state is not None
    client = JobSubmissionClient(state.dashboard, headers=state.auth())
    data = store / "max-data"
    entrypoint = (
        f"{sys.executable} -m training.train --root {store / 'store'} --model arith --version v2 --base arith@v1 "
        f"--data {data / 'train.jsonl'} --eval {data / 'eval.jsonl'} --method full --steps {FINETUNE_STEPS}"
    )
    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", str(ROOT))}
    return client.submit_job(entrypoint=entrypoint, runtime_env={"env_vars": env})


def _kill_controller_replica() -> int:
    from serving.control.stack import StackState, serve_status

    state = StackState.load("promotest")
    assert state is not None
    app = serve_status(state)["applications"]["promotion-controller"]
    (replica,) = app["deployments"]["PromotionController"]["replicas"]
    os.kill(int(replica["pid"]), signal.SIGKILL)
    return int(replica["pid"])


def _load(url: str, stop: threading.Event, outcomes: Counter[str]) -> None:
    i = 0
    with httpx.Client(timeout=120) as c:
        while not stop.is_set():
            a, b = PAIRS[i % len(PAIRS)]
            i += 1
            stream = i % 3 == 0
            body = {"model": "arith", "prompt": f"{a}+{b}=", "max_tokens": 5, "temperature": 0, "stream": stream}
            try:
                r = c.post(f"{url}/v1/completions", json=body)
                ok = r.status_code == 200 and (not stream or r.text.rstrip().endswith("data: [DONE]"))
                outcomes["ok" if ok and '"error"' not in r.text else f"fail-{r.status_code}"] += 1
            except httpx.HTTPError as exc:  # refused or cut connections are failures too
                outcomes[f"fail-{type(exc).__name__}"] += 1
            # paced (about 4 requests/s): on 2 cores an unpaced closed loop starves the new
            # version's engine start
            stop.wait(0.25)


def _promotions(stack: Stack) -> str:
    proc = subprocess.run(
        [SERVING, "promotions", "arith", "-c", str(stack.config)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_the_controller_promotes_what_training_publishes(stack: Stack, store: Path) -> None:
    assert _exact_max(stack.url, "arith") < 0.2  # v1 does not know the new task
    stop, outcomes = threading.Event(), Counter[str]()
    t = threading.Thread(target=_load, args=(stack.url, stop, outcomes))
    t.start()  # paced load from here to the end: not one request may fail
    try:
        _promoted_with_a_kill_mid_canary(stack, store)
        _worse_answers_rolled_back(stack, store)
        _metrics_show_the_outcome()
        # a re-run of `serving up` of the same stack config serves the promoted version
        subprocess.run([SERVING, "up", "-c", str(stack.config)], cwd=ROOT, check=True, timeout=600)
        ids = {m["id"] for m in httpx.get(f"{stack.url}/v1/models").json()["data"]}
        assert ids == {"arith", "arith@v2"}
    finally:
        stop.set()
        t.join(timeout=120)
    assert outcomes["ok"] > 100 and set(outcomes) == {"ok"}, outcomes
    print(f"requests during the test: {dict(outcomes)}")


def _promoted_with_a_kill_mid_canary(stack: Stack, store: Path) -> None:
    job = _submit_training(stack, store)
    rec = _wait_for(stack, "v2", {"stepping", "finishing", "promoted", "rolled_back"}, 1500)
    assert rec["status"] == "stepping", rec
    killed = _kill_controller_replica()  # mid-canary
    print(f"training job {job}; killed the controller replica (pid {killed}) at step {rec['step_index']}")
    rec = _wait_for(stack, "v2", {"promoted", "rolled_back", "aborted"}, 600)
    assert rec["status"] == "promoted", _promotions(stack)
    phases = [s["phase"] for s in rec["steps"]]  # type: ignore[attr-defined]
    assert "resume" in phases and phases[-1] == "promoted", phases
    manifest_file = store / "store" / "arith" / "v2" / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    assert (manifest["base"]["source"], manifest["base"]["ref"]) == ("store", "arith@v1")
    _pinned_to(stack, "v2", hashlib.sha256(manifest_file.read_bytes()).hexdigest())
    v2_score = manifest["eval"]["metrics"]["exact_match"]
    assert _exact_max(stack.url, "arith") >= v2_score - 0.05, manifest["eval"]
    ids = {m["id"] for m in httpx.get(f"{stack.url}/v1/models").json()["data"]}
    assert ids == {"arith", "arith@v2"}


def _pinned_to(stack: Stack, version: str, pin: str) -> None:
    """The promoted version is pinned to the manifest its gate checked: in the record, in
    ``live.json`` and in the args its replicas run with (Serve's deployed config)."""
    from serving.config import load_config
    from serving.control.stack import StackState, serve_status
    from serving.record import ControlStore

    cfg = load_config(stack.config)
    assert _history(stack)[-1]["manifest_sha256"] == pin
    control = ControlStore(cfg.checkpoint_root, cfg.name)
    assert [(v.version, v.manifest_sha256) for v in control.live()["arith"]] == [(version, pin)]
    state = StackState.load(cfg.name)
    assert state is not None
    app = serve_status(state)["applications"][f"arith--{version}"]
    assert app["deployed_app_config"]["args"]["spec"]["manifest_sha256"] == pin


def _metrics_show_the_outcome() -> None:
    """The controller's gauges on Ray's metrics endpoint: v2 at 100 %, v3 back to 0, phase idle."""
    from serving.metrics import samples

    deadline, seen = time.monotonic() + 60, {}
    while time.monotonic() < deadline:  # Ray's agent exports gauges every few seconds
        text = httpx.get("http://127.0.0.1:8089/metrics", timeout=30).text
        seen = {
            (name.removeprefix("ray_"), labels.get("version") or labels.get("phase")): value
            for name, labels, value in samples(text, "raystack_promotion")
            if labels.get("model") == "arith"
        }
        want = {
            ("raystack_promotion_weight_percent", "v2"): 100.0,
            ("raystack_promotion_weight_percent", "v3"): 0.0,
            ("raystack_promotion_phase", "idle"): 1.0,
            ("raystack_promotion_phase", "stepping"): 0.0,
        }
        if all(seen.get(k) == v for k, v in want.items()):
            return
        time.sleep(2)
    raise AssertionError(f"promotion gauges: {seen}")


def _worse_answers_rolled_back(stack: Stack, store: Path) -> None:
    """v3: v1's weights (they answer `max` badly) under a manifest that claims v2's score."""
    from serving.registry import CheckpointStore

    manifest = json.loads((store / "store" / "arith" / "v2" / "manifest.json").read_text())
    fields = {k: v for k, v in manifest.items() if k not in ("files", "sizes", "created_at")}
    CheckpointStore(str(store / "store")).publish(store / "store" / "arith" / "v1", {**fields, "version": "v3"})
    rec = _wait_for(stack, "v3", {"promoted", "rolled_back", "refused"}, 900)
    assert rec["status"] == "rolled_back" and "online eval" in str(rec["reason"]), rec["reason"]
    history = _promotions(stack)
    print(history)
    assert "arith@v3" in history and "online eval: exact_match" in history and "vs manifest" in history
    ids = {m["id"] for m in httpx.get(f"{stack.url}/v1/models").json()["data"]}
    assert ids == {"arith", "arith@v2"}


def test_gateway_restart_keeps_the_port_answering(stack: Stack) -> None:
    """A gateway change that Serve applies by restarting the (single) gateway replica, here new
    settings, under load: the replacement starts before the old replica stops (max_surge_percent),
    so the port the gateway replicas serve themselves never refuses a connection."""
    from serving.config import load_config
    from serving.control.requests import live_config
    from serving.control.serve_config import build_serve_config
    from serving.control.stack import StackState, deploy, serve_status
    from serving.record import ControlStore

    seed = load_config(stack.config)
    cfg = live_config(seed, ControlStore(seed.checkpoint_root, seed.name))
    state = StackState.load(cfg.name)
    assert state is not None

    def gateway_replicas() -> set[str]:
        app = serve_status(state)["applications"].get("gateway", {})
        dep = app.get("deployments", {}).get("Gateway", {})  # absent while Serve rebuilds the app
        return {r["replica_id"] for r in dep.get("replicas", []) if r.get("state") == "RUNNING"}

    old = gateway_replicas()
    stop, outcomes = threading.Event(), Counter[str]()

    def load() -> None:
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                try:
                    r = c.post(
                        f"{stack.url}/v1/completions",
                        json={"model": "arith", "prompt": "50-8=", "max_tokens": 3, "temperature": 0},
                    )
                    outcomes["ok" if r.status_code == 200 else f"fail-{r.status_code}"] += 1
                except httpx.HTTPError as exc:
                    outcomes[f"fail-{type(exc).__name__}"] += 1
                stop.wait(0.1)

    t = threading.Thread(target=load)
    t.start()
    try:
        changed = cfg.model_copy(
            update={"gateway": cfg.gateway.model_copy(update={"retries": cfg.gateway.retries + 1})}
        )
        deploy(state, build_serve_config(changed, stack.config.resolve().parent, seed=seed))
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            now = gateway_replicas()
            if now and not now & old:
                break
            time.sleep(1)
        time.sleep(3)
    finally:
        stop.set()
        t.join(timeout=60)
    assert gateway_replicas() and not gateway_replicas() & old, "the gateway replica was not replaced"
    assert outcomes["ok"] > 10 and set(outcomes) == {"ok"}, outcomes
