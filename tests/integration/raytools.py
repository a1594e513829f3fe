"""Run a short Python snippet as a Ray driver of the integration stack (in a subprocess, so the
test process never joins the cluster): what a test needs from Ray itself, e.g. the endpoint
records in Ray's key-value store or a handle on the quota actor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from serving.config import load_config
from serving.control.stack import StackState, ray_env
from tests.conftest import ROOT, Stack

__all__ = ["endpoint_records", "ray_run"]

RECORDS = """
from serving.gateway.replicas import RayKV, read_records
print(json.dumps([r.__dict__ | {"adapters": sorted(r.adapters)} for r in read_records(RayKV())]))
"""


def ray_run(stack: Stack, body: str, timeout_s: float = 120, env: dict[str, str] | None = None) -> Any:
    """Run ``body`` after ``ray.init`` to the stack's head (namespace ``raystack``); it must print
    one JSON value on its last line, which is returned."""
    state = StackState.load(load_config(stack.config).name)
    assert state is not None
    head = (
        "import json, ray\n"
        f"ray.init(address='127.0.0.1:{state.gcs_port}', namespace='raystack', logging_level='ERROR',"
        " log_to_driver=False)\n"
    )
    full = {**os.environ, **(env or {}), **ray_env(state.name)}
    out = subprocess.run(
        [sys.executable, "-c", head + body], cwd=ROOT, env=full, capture_output=True, text=True, timeout=timeout_s
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def endpoint_records(stack: Stack, app: str) -> list[dict[str, Any]]:
    """The endpoint records of ``app``'s model replicas (url, token, replica id, adapters, ...)
    that the gateways read from Ray's key-value store."""
    return [r for r in ray_run(stack, RECORDS) if r["app"] == app]
