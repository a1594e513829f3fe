"""A real S3 endpoint on loopback for tests: moto's standalone server (``python -m moto.server``).

It speaks the S3 HTTP API, so s3fs, botocore and the stack's Ray workers reach it as they would
reach AWS: through ``AWS_ENDPOINT_URL`` (honoured by botocore) and dummy credentials in the
environment. Nothing secret is on a command line, and no real credential is ever used: the
variables below replace any the caller has.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx

__all__ = ["S3Server", "moto_s3"]


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    env: dict[str, str]  # what a process needs to reach it (dummy credentials, endpoint, region)
    pid: int


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def moto_s3(timeout_s: float = 30) -> Iterator[S3Server]:
    """Start moto's S3 server on a free loopback port; stop it (by its pid) on exit."""
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env={k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {proc.returncode}")
            try:
                httpx.get(f"{endpoint}/moto-api/", timeout=2)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"moto server not answering on {endpoint}") from None
                time.sleep(0.1)
        yield S3Server(endpoint, env, proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
