"""Versions from S3 (moto's server on loopback) on the real stack: ``subtractor@v1`` was brought in
with ``serving import`` and every replica verified it before its engine started; a tampered
object is refused before any engine starts, with the file named, as is a manifest other than the
one a version is pinned to, and the live versions go on."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from serving.config import ModelVersion, load_config
from serving.control.serve_config import app_name, build_serve_config
from serving.control.stack import StackState, deploy, wait_running
from serving.replica.engine import VLLM_SERVER_MODULE
from tests.conftest import ROOT, SERVING, Stack
from tests.integration.conftest import BUCKET, s3_client


@pytest.fixture(scope="module")
def s3_env(stack: Stack, s3_stack_env: dict[str, str]) -> dict[str, str]:
    if not s3_stack_env:
        pytest.skip("a reused stack: no S3 server of this run")
    return s3_stack_env


SUB = [(50, 8), (90, 45), (77, 70), (31, 12), (99, 1), (64, 32), (8, 50), (40, 41)]


def _subtracts(stack: Stack) -> bool:
    """The trained weights answer: most of eight held-in-mind subtractions right (an untrained or
    wrong model gets next to none)."""
    return sum(_ask(stack, "subtractor", f"{a}-{b}=") == str(a - b) for a, b in SUB) >= 4


def _ask(stack: Stack, model: str, prompt: str) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": 5, "temperature": 0}
    r = httpx.post(f"{stack.url}/v1/completions", json=body, headers=stack.headers(), timeout=60)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"]).strip()


def test_s3_version_verified_on_the_node_and_served(stack: Stack, s3_env: dict[str, str]) -> None:
    assert load_config(stack.config).checkpoint_root == f"s3://{BUCKET}/store"
    markers = list(Path(s3_env["RAYSTACK_CACHE_DIR"]).glob("subtractor/v1/*.verified.json"))
    assert len(markers) == 1  # one fetch and verification for the node, whatever the replicas
    marker = json.loads(markers[0].read_text())
    assert marker["source"] == f"s3://{BUCKET}/store/subtractor/v1" and "model.safetensors" in marker["files"]
    assert _subtracts(stack)  # the trained weights, through the gateway


def _engine_environs() -> list[dict[str, str]]:
    """The environment of every vLLM server process on this machine (the stack's engines)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and VLLM_SERVER_MODULE.encode() in (proc / "cmdline").read_bytes():
                pairs = (proc / "environ").read_bytes().split(b"\0")
                found.append(dict(p.decode().split("=", 1) for p in pairs if b"=" in p))
        except OSError:  # the process ended while we looked
            continue
    return found


def test_the_engines_do_not_inherit_the_stores_credentials(stack: Stack, s3_env: dict[str, str]) -> None:
    """The replicas fetch from S3 with the credentials in their environment; the vLLM processes they
    start read a verified local folder and get none of them."""
    engines = _engine_environs()
    assert len(engines) >= 2, "no engine process found"
    assert all("AWS_ACCESS_KEY_ID" in s3_env and not any(k.startswith("AWS_") for k in env) for env in engines)


def test_tampered_s3_version_refused_before_the_engine(stack: Stack, s3_env: dict[str, str]) -> None:
    env = {**os.environ, **s3_env}
    src = str(ROOT / "checkpoints" / "subtractor" / "v1")
    cmd = [SERVING, "import", src, "--model", "subtractor", "--version", "v2", "-c", str(stack.config)]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, timeout=120, capture_output=True)
    s3 = s3_client(s3_env)
    key = "store/subtractor/v2/model.safetensors"
    size = s3.head_object(Bucket=BUCKET, Key=key)["ContentLength"]
    s3.put_object(Bucket=BUCKET, Key=key, Body=b"\x00" * size)  # same size, other bytes

    # a promotion verifies first: refused, nothing deployed
    proc = subprocess.run(
        [SERVING, "promote", "subtractor", "v2", "-c", str(stack.config)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode != 0 and "refused" in out and "file model.safetensors does not match" in out, out

    # deployed anyway (as if tampered after that check): the replica refuses before vLLM starts;
    # and v1's checkpoint under a pin its manifest does not have (as if the version had been
    # replaced, files and manifest together, after its promotion) is refused on the manifest
    cfg = load_config(stack.config)
    state = StackState.load(cfg.name)
    assert state is not None
    m = cfg.model("subtractor")
    v1_path = f"s3://{BUCKET}/store/subtractor/v1"
    pinned = ModelVersion(version="v1p", weight=0, path=v1_path, manifest_sha256="0" * 64)
    bad = cfg.model_copy(
        update={
            "models": [
                x.model_copy(update={"versions": [*x.versions, ModelVersion(version="v2", weight=0), pinned]})
                if x.name == "subtractor"
                else x
                for x in cfg.models
            ]
        }
    )
    base = stack.config.resolve().parent
    try:
        # seed: the promotion controller keeps its args (a changed one restarts and re-applies the record)
        deploy(state, build_serve_config(bad, base, seed=cfg))
        with pytest.raises(RuntimeError) as failed:
            wait_running(state, [app_name(m.name, "v2")], 300, log=lambda _m: None)
        message = " ".join(str(failed.value).split())
        assert "refusing to start vLLM for subtractor@v2" in message, message
        assert "file model.safetensors does not match its sha256" in message, message
        with pytest.raises(RuntimeError) as failed:
            wait_running(state, [app_name(m.name, "v1p")], 300, log=lambda _m: None)
        message = " ".join(str(failed.value).split())
        assert f"refusing to start vLLM for subtractor@v1p from {v1_path}" in message, message
        assert "subtractor@v1: manifest.json has sha256" in message and f"not the {'0' * 16}... pinned" in message
    finally:
        deploy(state, build_serve_config(cfg, base, seed=cfg))
    assert _subtracts(stack)  # v1 serves on
