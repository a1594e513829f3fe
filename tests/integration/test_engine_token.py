"""The engine port of a real replica of the stack: every route vLLM registers needs the replica's
token, except /health; the token is not on any command line."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from serving.config import load_config
from serving.control.serve_config import build_serve_config
from serving.replica.engine import EngineSpec, vllm_command, vllm_env
from tests.conftest import Stack
from tests.integration.raytools import endpoint_records

pytestmark = pytest.mark.integration


def _engine_routes(stack: Stack, app: str, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """(method, path) of every route vLLM's server registers, built in this process from the
    replica's own command line and engine environment (the served app is that same FastAPI app)."""
    from starlette.routing import Mount, Route
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cfg = load_config(stack.config)
    sc = build_serve_config(cfg, Path(stack.config).parent)
    spec = EngineSpec.model_validate(next(a for a in sc["applications"] if a["name"] == app)["args"]["spec"])
    for key, value in vllm_env(spec).items():  # e.g. the runtime LoRA routes of a base of adapters
        monkeypatch.setenv(key, value)
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(vllm_command(spec, "127.0.0.1", 1)[2:])
    routes: set[tuple[str, str]] = set()
    for r in build_app(args, ("generate",)).routes:
        path = re.sub(r"\{[^}]+\}", "x", getattr(r, "path", ""))
        if isinstance(r, Mount):
            routes.add(("GET", path))
        elif isinstance(r, Route):
            routes |= {(m, path) for m in (r.methods or {"GET"}) if m != "HEAD"}
    return sorted(routes)


def test_every_engine_route_needs_the_replica_token(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    records = endpoint_records(stack, "adder--v1")
    assert len(records) == 2  # both replicas published their endpoint
    routes = _engine_routes(stack, "adder--v1", monkeypatch)
    paths = {p for _, p in routes}
    assert {"/invocations", "/tokenize", "/metrics", "/v1/completions", "/health"} <= paths, paths
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= paths, paths  # adder serves adapters
    for rec in records:
        url, token = rec["url"], rec["token"]
        with httpx.Client(base_url=url, timeout=60) as c:
            for method, path in routes:
                body = {} if method == "POST" else None
                bare = c.request(method, path, json=body)
                good = c.request(method, path, json=body, headers={"authorization": f"Bearer {token}"})
                if path == "/health":
                    assert bare.status_code == 200
                    continue
                assert bare.status_code == 401, (method, path, bare.status_code, bare.text[:200])
                wrong = c.request(method, path, json=body, headers={"authorization": "Bearer nope"})
                assert wrong.status_code == 401, (method, path)
                assert good.status_code != 401, (method, path, good.text[:200])
            # the replica's own scrape: /metrics with the token has the engine's gauges
            m = c.get("/metrics", headers={"authorization": f"Bearer {token}"})
            assert m.status_code == 200 and "vllm:num_requests_running" in m.text
        # and the token is on no command line (ps shows those to every local user)
        for proc in Path("/proc").iterdir():
            try:
                cmdline = (proc / "cmdline").read_bytes() if proc.name.isdigit() else b""
            except OSError:
                continue
            assert token.encode() not in cmdline, proc.name
