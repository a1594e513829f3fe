"""Record real vLLM streams for the splice tests (tests/unit/test_gateway_migration.py): one vLLM
server started as a model replica starts it (the integration stack's ``adder`` engine spec), and
for a completion and a chat request: the greedy stream without and with ``return_token_ids``, the
continuation a migration would send after ``CUT`` tokens, and what a client gets when the
EngineCore is SIGKILLed mid-stream. Writes tests/unit/data/vllm_streams.json.

    flock /tmp/raystack-heavy.lock python -m tests.support.record_streams  # needs checkpoints/adder/v1
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from serving.config import load_config
from serving.control.serve_config import build_serve_config
from serving.replica.engine import EngineSpec, engine_environ, vllm_command
from serving.replica.node import free_port
from serving.replica.placement import engine_core_pid

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "unit" / "data" / "vllm_streams.json"
CUT = 10
COMPLETION = {"model": "adder", "prompt": "12+34=", "max_tokens": 40, "ignore_eos": True, "temperature": 0}
CHAT = {
    "model": "adder",
    "messages": [{"role": "user", "content": "What is 12+34?"}],
    "max_tokens": 40,
    "ignore_eos": True,
    "temperature": 0,
}
USAGE = {"include_usage": True, "continuous_usage_stats": True}


def _spec() -> EngineSpec:
    cfg = load_config(ROOT / "tests" / "integration" / "stack.yaml")
    apps = build_serve_config(cfg, ROOT / "tests" / "integration")["applications"]
    spec = next(a["args"]["spec"] for a in apps if a["name"] == "adder--v1")
    return EngineSpec.model_validate(spec)


def _stream(c: httpx.Client, url: str, path: str, body: dict[str, Any]) -> str:
    with c.stream("POST", url + path, json={**body, "stream": True, "stream_options": USAGE}) as r:
        assert r.status_code == 200, r.read()
        return r.read().decode()


def _ids(raw: str, kind: str) -> tuple[list[int], list[int], list[bool]]:
    """Prompt ids, generated ids, and for each generated id whether its chunk carried text, of a
    stream recorded with return_token_ids."""
    prompt: list[int] = []
    out: list[int] = []
    texted: list[bool] = []
    for ev in raw.split("\n\n"):
        if not ev.startswith("data: {"):
            continue
        chunk = json.loads(ev[6:])
        if kind == "chat" and chunk.get("prompt_token_ids"):
            prompt = chunk["prompt_token_ids"]
        for c in chunk["choices"]:
            if kind == "completion" and c.get("prompt_token_ids"):
                prompt = c["prompt_token_ids"]
            ids = c.get("token_ids") or []
            out += ids
            texted += [bool(c.get("text") or (c.get("delta") or {}).get("content"))] * len(ids)
    return prompt, out, texted


def _killed(c: httpx.Client, url: str, api_pid: int) -> str:
    """A long stream whose EngineCore is SIGKILLed after its first chunks."""
    body = {**COMPLETION, "max_tokens": 400, "return_token_ids": True}
    core = engine_core_pid(api_pid)
    assert core is not None
    got: list[str] = []
    with c.stream("POST", url + "/v1/completions", json={**body, "stream": True, "stream_options": USAGE}) as r:
        for i, text in enumerate(r.iter_text()):
            got.append(text)
            if i == 3:
                threading.Timer(0.0, os.kill, (core, signal.SIGKILL)).start()
    return "".join(got)


def main() -> None:
    spec = _spec()
    port, token = free_port(), secrets.token_urlsafe(16)
    env = engine_environ(dict(os.environ), spec, None, token)
    proc = subprocess.Popen([sys.executable, *vllm_command(spec, "127.0.0.1", port)], env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    out: dict[str, Any] = {"cut": CUT}
    try:
        with httpx.Client(timeout=120, headers={"authorization": f"Bearer {token}"}) as c:
            deadline = time.monotonic() + 600
            while True:
                try:
                    if c.get(url + "/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline and proc.poll() is None, "vLLM did not start"
                time.sleep(1)
            for kind, path, body in (
                ("completion", "/v1/completions", COMPLETION),
                ("chat", "/v1/chat/completions", CHAT),
            ):
                plain = _stream(c, url, path, body)
                with_ids = _stream(c, url, path, {**body, "return_token_ids": True})
                prompt, ids, texted = _ids(with_ids, kind)
                cont = {**COMPLETION, "prompt": prompt + ids[:CUT], "max_tokens": 40 - CUT, "return_token_ids": True}
                out[kind] = {
                    "request": body,
                    "plain": plain,
                    "with_ids": with_ids,
                    "continuation_request": cont,
                    "continuation": _stream(c, url, "/v1/completions", cont),
                }
                if kind == "chat":  # a cut right after a token without text: chat continues before it
                    bare = max(k for k in range(1, CUT) if not texted[k - 1] and texted[k - 2])
                    back = {**cont, "prompt": prompt + ids[: bare - 1], "max_tokens": 40 - bare + 1}
                    out[kind] |= {
                        "bare_cut": bare,
                        "bare_request": back,
                        "bare_continuation": _stream(c, url, "/v1/completions", back),
                    }
            out["killed"] = _killed(c, url, proc.pid)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", OUT)


if __name__ == "__main__":
    main()
