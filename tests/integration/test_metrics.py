"""The stack's metrics through a real Prometheus (issue 7): Prometheus scrapes the local Ray head's
metrics-export port every second, and PromQL must find exactly the requests this test sent.

Other tests in the session also send requests as tenant ``main``, so the test reads each counter
through PromQL before and after its own requests (after waiting for it to settle: Ray's exporter
reports with a delay of several seconds) and checks the difference.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from serving.config import load_config
from serving.replica.node import free_port
from tests.conftest import Stack

pytestmark = pytest.mark.integration

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
SEL = 'tenant="main",model="adder"'
REQUESTS = f'sum({{__name__=~"ray_raystack_requests(_total)?",{SEL},status_class="2xx"}})'
TTFT_COUNT = f"sum(ray_raystack_time_to_first_token_seconds_count{{{SEL}}})"
E2E_COUNT = f"sum(ray_raystack_request_latency_seconds_count{{{SEL}}})"
COMPLETION_TOKENS = f'sum({{__name__=~"ray_raystack_completion_tokens(_total)?",{SEL}}})'
ENGINE_GAUGES = (
    "ray_raystack_engine_kv_cache_usage_ratio",
    "ray_raystack_engine_requests_running",
    "ray_raystack_engine_requests_waiting",
)
N_STREAM, N_PLAIN, MAX_TOKENS = 4, 3, 4


@pytest.fixture(scope="module")
def prometheus(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], float | None]]:
    """A real Prometheus on loopback scraping the stack's Ray metrics port every second; yields
    a PromQL instant-query function (the sum of the result vector, None if empty)."""
    if not Path(PROMETHEUS).exists():
        pytest.skip("prometheus is not installed (Debian: apt-get install prometheus)")
    port = load_config(stack.config).local_ray.metrics_export_port
    work = tmp_path_factory.mktemp("prometheus")
    (work / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: ray\n    static_configs: [{{targets: ['127.0.0.1:{port}']}}]\n"
    )
    url = f"http://127.0.0.1:{free_port()}"
    cmd = [
        PROMETHEUS,
        f"--config.file={work / 'prometheus.yml'}",
        f"--storage.tsdb.path={work / 'data'}",
        f"--web.listen-address={url.removeprefix('http://')}",
        "--log.level=warn",
    ]
    log = open(work / "prometheus.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)

    def query(expr: str) -> float | None:
        r = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
        r.raise_for_status()
        result = r.json()["data"]["result"]
        return sum(float(s["value"][1]) for s in result) if result else None

    try:
        _until(lambda: query('up{job="ray"}') == 1, 60, "Prometheus scraping the Ray metrics port")
        yield query
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


def _until(ok: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if ok():
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def _settled(
    query: Callable[[str], float | None], exprs: list[str], quiet_s: float = 12, timeout_s: float = 90
) -> list[float]:
    """Values that stayed the same for ``quiet_s`` (longer than Ray's reporting delay)."""
    deadline = time.monotonic() + timeout_s
    last = [query(e) or 0.0 for e in exprs]
    since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(2)
        now = [query(e) or 0.0 for e in exprs]
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return now
    raise AssertionError(f"metrics never settled: {dict(zip(exprs, last, strict=True))}")


def _send(stack: Stack) -> int:
    """N_STREAM streamed and N_PLAIN plain chat requests to adder as tenant main; returns the
    completion tokens the client saw."""
    tokens = 0
    body = {
        "model": "adder",
        "messages": [{"role": "user", "content": "12+30="}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    with httpx.Client(base_url=stack.url, headers=stack.headers(), timeout=60) as c:
        for _ in range(N_STREAM):
            with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                assert "data: [DONE]" in "".join(r.iter_text())
            tokens += MAX_TOKENS
        for _ in range(N_PLAIN):
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            tokens += r.json()["usage"]["completion_tokens"]
    return tokens


def test_prometheus_counts_exactly_the_requests_sent(stack: Stack, prometheus: Callable[[str], float | None]) -> None:
    exprs = [REQUESTS, TTFT_COUNT, E2E_COUNT, COMPLETION_TOKENS]
    before = _settled(prometheus, exprs)
    tokens = _send(stack)
    want = [before[0] + N_STREAM + N_PLAIN, before[1] + N_STREAM, before[2] + N_STREAM + N_PLAIN, before[3] + tokens]
    _until(
        lambda: [prometheus(e) or 0.0 for e in exprs] == want,
        90,
        f"{dict(zip(exprs, want, strict=True))} (before: {before})",
    )
    # nothing beyond what was sent shows up later
    assert _settled(prometheus, exprs, quiet_s=8) == want


def test_ttft_histogram_buckets_and_quantile(stack: Stack, prometheus: Callable[[str], float | None]) -> None:
    inf = prometheus(f'sum(ray_raystack_time_to_first_token_seconds_bucket{{{SEL},le="+Inf"}})')
    count = prometheus(TTFT_COUNT)
    assert inf is not None and inf == count
    p50 = prometheus(f"histogram_quantile(0.5, sum by (le) (ray_raystack_time_to_first_token_seconds_bucket{{{SEL}}}))")
    assert p50 is not None and 0 < p50 < 60
    assert (prometheus(f"sum(ray_raystack_inter_token_latency_seconds_count{{{SEL}}})") or 0) > 0


def test_engine_gauges_are_exported(stack: Stack, prometheus: Callable[[str], float | None]) -> None:
    for name in ENGINE_GAUGES:
        for model in ("adder", "subtractor"):
            expr = f'count({name}{{model="{model}",version="v1"}})'
            _until(lambda e=expr: prometheus(e) is not None, 60, f"{name} for {model}")
    usage = prometheus('max(ray_raystack_engine_kv_cache_usage_ratio{model="adder"})')
    assert usage is not None and 0 <= usage <= 1


def test_embeddings_count_as_requests_and_prompt_tokens_of_their_model(
    stack: Stack, prometheus: Callable[[str], float | None]
) -> None:
    sel = 'tenant="main",model="minilm"'
    exprs = [
        f'sum({{__name__=~"ray_raystack_requests(_total)?",{sel},status_class="2xx"}})',
        f'sum({{__name__=~"ray_raystack_prompt_tokens(_total)?",{sel}}})',
        f"sum(ray_raystack_request_latency_seconds_count{{{sel}}})",
    ]
    before = _settled(prometheus, exprs)
    tokens = 0
    with httpx.Client(base_url=stack.url, headers=stack.headers(), timeout=60) as c:
        for text in ("a cat sits", "a kitten rests", "stock market crash"):
            r = c.post("/v1/embeddings", json={"model": "minilm", "input": text})
            assert r.status_code == 200, r.text
            tokens += r.json()["usage"]["prompt_tokens"]
    want = [before[0] + 3, before[1] + tokens, before[2] + 3]
    _until(lambda: [prometheus(e) or 0.0 for e in exprs] == want, 90, f"{want} (before: {before})")
