"""Fine-tune -> serve beside the base -> promote under load -> refuse or roll back broken versions.

v1 of model ``arith`` is the default addition model the training job built for the main stack,
brought into this test's own store with ``serving import``. v2 is fine-tuned here from
``arith@v1`` on a user-style JSONL file of a task the base does not know (``max 37 45=`` ->
``45``, written by ``python -m training.datasets max``); through the API its answers follow the new
data at the manifest's score while the base's do not.
"""

from __future__ import annotations

import json
import shutil
import subprocess
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
FINETUNE_STEPS = 500


def _config(tmp: Path) -> Path:
    data = {
        "name": "promotest",
        "checkpoint_root": str(tmp / "store"),
        "gateway": {"port": 8013, "proxy_port": 8113},
        "auth": {"mode": "open"},
        "local_ray": {"gcs_port": 6394, "dashboard_port": 8279, "metrics_export_port": 8089, "num_cpus": 8},
        "models": [
            {
                "name": "arith",
                "gate": {"metric": "exact_match", "min": 0.9},
                "versions": [{"version": "v1"}],
                "engine": {"max_model_len": 256, "dtype": "float32", "max_num_seqs": 32},
            }
        ],
    }
    path = tmp / "promotest.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from training.datasets import write_dataset
    from training.train import train

    tmp = tmp_path_factory.mktemp("promotion")
    source = ROOT / "checkpoints" / "adder" / "v1"
    if not (source / "manifest.json").exists():  # built by `serving up` of the main stacks
        train("adder", "v1", str(ROOT / "checkpoints"), base="init:qwen2-tiny", data="builtin:add")
    root = str(tmp / "store")
    imported = subprocess.run(
        [SERVING, "import", str(source), "--model", "arith", "--version", "v1", "--root", root],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert imported.returncode == 0, imported.stdout + imported.stderr
    data, held_out = write_dataset("max", tmp / "max-data")  # the user's JSONL
    train("arith", "v2", root, base="arith@v1", data=str(data), eval_data=str(held_out), steps=FINETUNE_STEPS)
    return tmp


@pytest.fixture(scope="module")
def stack(store: Path) -> Iterator[Stack]:
    routes = ROOT / ".run" / "promotest.versions.json"  # promotion state of earlier runs
    routes.unlink(missing_ok=True)
    try:
        with running_stack(_config(store)) as s:
            yield s
    finally:
        routes.unlink(missing_ok=True)


def _answer(url: str, model: str, prompt: str) -> tuple[int, str]:
    r = httpx.post(
        f"{url}/v1/completions", timeout=120, json={"model": model, "prompt": prompt, "max_tokens": 5, "temperature": 0}
    )
    return r.status_code, (r.json()["choices"][0]["text"].strip() if r.status_code == 200 else r.text)


def _exact(url: str, model: str, op: str) -> float:
    if op == "max":
        return sum(_answer(url, model, f"max {a} {b}=") == (200, str(max(a, b))) for a, b in PAIRS) / len(PAIRS)
    want = (lambda a, b: a + b) if op == "+" else (lambda a, b: a - b)
    return sum(_answer(url, model, f"{a}{op}{b}=") == (200, str(want(a, b))) for a, b in PAIRS) / len(PAIRS)


def _promote(stack: Stack, version: str, steps: str = "10,50,100") -> subprocess.CompletedProcess[str]:
    # TTFT limit 5x (default 2x): on 2 cores a just-started engine answered at 2.2x the live one's
    # TTFT in a CI run and the canary was (correctly, by its policy) rolled back; this test is about
    # zero failed requests and the task switch; rollbacks are shown by v5 and tests/unit
    return subprocess.run(
        [
            SERVING,
            "promote",
            "arith",
            version,
            "-c",
            str(stack.config),
            "--steps",
            steps,
            "--step-seconds",
            "8",
            "--max-ttft-ratio",
            "5",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_promotion_under_load_then_broken_versions(stack: Stack, store: Path) -> None:
    v1_add = _exact(stack.url, "arith", "+")
    assert v1_add >= 0.85, v1_add
    manifest = json.loads((store / "store" / "arith" / "v2" / "manifest.json").read_text())
    assert manifest["base"]["source"] == "store" and manifest["base"]["ref"] == "arith@v1"
    assert manifest["training"]["method"] == "full" and manifest["training"]["data"]["rows"] > 0
    v2_score = manifest["eval"]["metrics"]["exact_match"]
    assert v2_score >= 0.8, manifest["eval"]
    assert _exact(stack.url, "arith", "max") < 0.2  # the base does not know the new task

    stop, outcomes, v1_answers = threading.Event(), Counter[str](), []

    def load() -> None:
        i = 0
        with httpx.Client(timeout=120) as c:
            while not stop.is_set():
                a, b = PAIRS[i % len(PAIRS)]
                i += 1
                stream = i % 3 == 0
                try:
                    r = c.post(
                        f"{stack.url}/v1/completions",
                        json={
                            "model": "arith",
                            "prompt": f"{a}+{b}=",
                            "max_tokens": 5,
                            "temperature": 0,
                            "stream": stream,
                        },
                    )
                    ok = r.status_code == 200 and (not stream or r.text.rstrip().endswith("data: [DONE]"))
                    ok = ok and '"error"' not in r.text
                    outcomes["ok" if ok else f"fail-{r.status_code}"] += 1
                    if i % 5 == 0:
                        v1_answers.append(_answer(stack.url, "arith@v1", f"{a}+{b}="))
                except httpx.HTTPError as exc:  # refused or cut connections are failures too
                    outcomes[f"fail-{type(exc).__name__}"] += 1
                # paced (about 4 requests/s): on 2 cores an unpaced closed loop starves the new
                # version's engine start (measured: 9 minutes instead of 40 s)
                stop.wait(0.25)

    t = threading.Thread(target=load)
    t.start()
    try:
        proc = _promote(stack, "v2")
    finally:
        stop.set()
        t.join(timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "promoted: arith@v2" in proc.stdout
    # zero failed requests during the promotion
    assert outcomes["ok"] > 20 and set(outcomes) == {"ok"}, outcomes
    # arith@v1 answered as v1 (addition) until it was removed, then it is unknown
    statuses = [s for s, _ in v1_answers]
    assert statuses and set(statuses) <= {200, 404}
    first_404 = statuses.index(404) if 404 in statuses else len(statuses)
    assert all(s == 200 for s in statuses[:first_404]) and all(s == 404 for s in statuses[first_404:])
    assert _answer(stack.url, "arith@v1", "12+30=")[0] == 404

    # after it: v2 answers the new data's task at its manifest's score (within a few points)
    v2_max = _exact(stack.url, "arith", "max")
    assert v2_max >= v2_score - 0.05, (v2_max, manifest["eval"])

    # v3: corrupt weights -> refused by the registry, nothing deployed
    v3 = store / "store" / "arith" / "v3"
    shutil.copytree(store / "store" / "arith" / "v2", v3)
    m3 = json.loads((v3 / "manifest.json").read_text())
    m3["version"] = "v3"
    (v3 / "manifest.json").write_text(json.dumps(m3))
    with open(v3 / "model.safetensors", "r+b") as f:
        f.seek(200)
        f.write(b"\x00" * 64)
    proc = _promote(stack, "v3")
    assert proc.returncode != 0 and "refused" in proc.stdout and "model.safetensors" in proc.stdout

    # v4: below the eval gate -> refused
    v4 = store / "store" / "arith" / "v4"
    shutil.copytree(store / "store" / "arith" / "v2", v4)
    m4 = json.loads((v4 / "manifest.json").read_text())
    m4["version"], m4["eval"]["metrics"]["exact_match"] = "v4", 0.31
    (v4 / "manifest.json").write_text(json.dumps(m4))
    proc = _promote(stack, "v4")
    assert proc.returncode != 0 and "below the gate" in proc.stdout

    # v5: passes the registry but its engine cannot start -> rolled back automatically
    from serving.registry import hash_tree

    v5 = store / "store" / "arith" / "v5"
    shutil.copytree(store / "store" / "arith" / "v2", v5)
    cfg = json.loads((v5 / "config.json").read_text())
    cfg["num_attention_heads"] = 3  # hidden size no longer divisible: the model cannot load
    (v5 / "config.json").write_text(json.dumps(cfg))
    m5 = json.loads((v5 / "manifest.json").read_text())
    (v5 / "manifest.json").unlink()
    m5["version"], m5["files"] = "v5", hash_tree(v5)
    m5["sizes"] = {rel: (v5 / rel).stat().st_size for rel in m5["files"]}
    (v5 / "manifest.json").write_text(json.dumps(m5))
    started = time.monotonic()
    proc = _promote(stack, "v5")
    assert proc.returncode == 1 and "rolled_back" in proc.stdout, proc.stdout + proc.stderr
    print(f"v5 rolled back after {time.monotonic() - started:.0f}s")
    # v2 still serving, alone
    assert _exact(stack.url, "arith", "max") >= v2_score - 0.05
    ids = {m["id"] for m in httpx.get(f"{stack.url}/v1/models").json()["data"]}
    assert ids == {"arith", "arith@v2"}


def test_gateway_restart_keeps_the_port_answering(stack: Stack) -> None:
    """A gateway change that Serve applies by restarting the (single) gateway replica, here new
    settings, under load: the replacement starts before the old replica stops (max_surge_percent),
    so the port the gateway replicas serve themselves never refuses a connection."""
    from serving.config import load_config
    from serving.control.promotion import apply_routes, routes_path
    from serving.control.serve_config import build_serve_config
    from serving.control.stack import StackState, deploy, serve_status

    cfg = apply_routes(load_config(stack.config), routes_path(ROOT / ".run", "promotest"))
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
        deploy(state, build_serve_config(changed, stack.config.resolve().parent))
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
