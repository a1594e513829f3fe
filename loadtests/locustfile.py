"""Locust users that speak the OpenAI API with streaming, driven by a scenario file.

Run through ``python -m loadtests.run`` (which sets the environment below), or by hand:

    LOADTEST_SCENARIO=single-model locust -f loadtests/locustfile.py --headless \
        --host http://127.0.0.1:8000 --csv reports/x/locust --html reports/x/report.html

Environment: ``LOADTEST_SCENARIO`` (name or path), ``LOADTEST_DURATION_S`` (optional: stretch
the scenario's shape to this many seconds), ``LOADTEST_MODEL`` (optional: send every request to
this model), ``OPENAI_API_KEY`` (optional bearer key).

Per request three kinds of rows reach Locust's statistics:
- ``POST <request name>``: the whole streamed request; response length = completion tokens,
  so tokens/s = Requests/s x Average Content Size;
- ``TTFT <request name>`` and ``TTFT ALL``: time to first token (ms);
- ``ITL <request name>`` and ``ITL ALL``: mean inter-token latency of the request (ms).
Locust's "Aggregated" row mixes all three kinds; the reports use the per-kind rows.
"""

from __future__ import annotations

import os
import random
import time

import httpx
from locust import LoadTestShape, User, between, constant, events, task

from loadtests.scenario import load_scenario
from loadtests.workload import Outcome, RequestFactory, StreamMeter, outcome_of_body

SCENARIO = load_scenario(os.environ.get("LOADTEST_SCENARIO", "single-model"))
SCENARIO = SCENARIO.scaled(float(os.environ.get("LOADTEST_DURATION_S") or 0) or None)
SCENARIO = SCENARIO.with_model(os.environ.get("LOADTEST_MODEL") or None)
ALL = "ALL"


def _fire(kind: str, name: str, ms: float, length: int = 0, exc: Exception | None = None) -> None:
    events.request.fire(
        request_type=kind, name=name, response_time=ms, response_length=length, exception=exc, context={}
    )


class OpenAIStreamingUser(User):
    """Sends the scenario's weighted request mix, one request at a time, and reports TTFT/ITL."""

    wait_time = between(*SCENARIO.wait_s) if SCENARIO.wait_s[1] > 0 else constant(0)

    def on_start(self) -> None:
        key = os.environ.get("OPENAI_API_KEY")
        headers = {"authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.Client(
            base_url=self.host, headers=headers, timeout=httpx.Timeout(SCENARIO.timeout_s, connect=10)
        )
        rng = random.Random()
        self.factories = [RequestFactory(r, rng) for r in SCENARIO.requests]
        self.weights = [r.weight for r in SCENARIO.requests]

    def on_stop(self) -> None:
        self.http.close()

    def _send(self, f: RequestFactory) -> Outcome:
        body = f.body()
        start = time.perf_counter()
        try:
            with self.http.stream("POST", f.path, json=body) as resp:
                if resp.status_code != 200 or not f.spec.stream:
                    return outcome_of_body(resp.status_code, resp.read(), start, time.perf_counter())
                meter = StreamMeter(start)
                for line in resp.iter_lines():
                    meter.line(line, time.perf_counter())
                return meter.outcome(time.perf_counter())
        except httpx.HTTPError as exc:
            return Outcome(False, time.perf_counter() - start, error=f"{type(exc).__name__}: {exc}"[:200])

    @task
    def request(self) -> None:
        f = random.choices(self.factories, self.weights)[0]
        out = self._send(f)
        name = f.spec.name
        _fire("POST", name, out.latency_s * 1000, out.tokens, None if out.ok else RuntimeError(out.error))
        if out.ok and out.ttft_s is not None:
            _fire("TTFT", name, out.ttft_s * 1000)
            _fire("TTFT", ALL, out.ttft_s * 1000)
        if out.ok and out.itl_s is not None:
            _fire("ITL", name, out.itl_s * 1000)
            _fire("ITL", ALL, out.itl_s * 1000)


class ScenarioShape(LoadTestShape):
    """The scenario's stages (constant load, ramps, bursts); the run ends after the last stage."""

    def tick(self) -> tuple[int, float] | None:
        return SCENARIO.users_at(self.get_run_time())
