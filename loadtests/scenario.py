"""Load-test scenarios: one YAML file per scenario with its request mix, load shape and SLOs.

A scenario names what to send (``requests``: weighted request templates), how many users send it
over time (``shape``: stages of constant user counts, which also express bursts), and what must
hold at the end (``slo``). Files live in ``loadtests/scenarios/<name>.yaml``; a path works too.
Validated with pydantic (unknown fields rejected), like the stack config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from serving.config import read_yaml, validation_message

__all__ = [
    "SCENARIO_DIR",
    "RequestSpec",
    "SLO",
    "Scenario",
    "ScenarioError",
    "SharedPrefix",
    "Stage",
    "load_scenario",
    "scenario_names",
]

SCENARIO_DIR = Path(__file__).resolve().parent / "scenarios"


class ScenarioError(ValueError):
    """A scenario file is missing or invalid (the message names the file and field)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Stage(_Strict):
    """Hold ``users`` concurrent users for ``duration_s`` (reached at ``spawn_rate`` users/s)."""

    duration_s: float = Field(gt=0)
    users: int = Field(ge=0)
    spawn_rate: float = Field(10.0, gt=0, description="Users started (or stopped) per second.")


class SharedPrefix(_Strict):
    """A few long system prompts shared by many requests (exercises prefix caching and
    prefix-affinity routing). Lengths are in characters: one token each with the project's
    character-level tokenizers, roughly a quarter token each with a BPE tokenizer."""

    count: int = Field(4, ge=1, le=64)
    chars: int = Field(400, ge=1, description="Length of each system prompt.")
    seed: int = 0


class RequestSpec(_Strict):
    """One kind of request in the mix. ``prompt`` is a template: ``{a}`` and ``{b}`` become random
    two-digit numbers, ``{text}`` random text of ``user_chars`` characters."""

    name: str = Field(description="Label in reports, e.g. 'chat adder'.")
    model: str
    endpoint: Literal["chat", "completion"] = "chat"
    weight: int = Field(1, ge=1)
    prompt: str = "{a}+{b}="
    user_chars: int = Field(16, ge=1)
    max_tokens: int = Field(8, ge=1)
    ignore_eos: bool = Field(True, description="Always generate max_tokens (vLLM extension).")
    temperature: float = Field(0.0, ge=0)
    stream: bool = True
    shared_prefix: SharedPrefix | None = Field(None, description="Prepend one of a few shared system prompts.")


class SLO(_Strict):
    """Thresholds the run must meet; unset ones are not checked."""

    max_error_rate: float = Field(0.01, ge=0, le=1)
    ttft_p99_ms: float | None = Field(None, gt=0)
    ttft_p50_ms: float | None = Field(None, gt=0)
    itl_p50_ms: float | None = Field(None, gt=0)
    min_tokens_per_s: float | None = Field(None, ge=0)
    min_requests: int = Field(1, ge=0, description="Fewer finished requests than this fails the run.")


class Scenario(_Strict):
    name: str
    description: str = ""
    requests: list[RequestSpec] = Field(min_length=1)
    shape: list[Stage] = Field(min_length=1)
    wait_s: tuple[float, float] = Field((0.0, 0.0), description="Think time between a user's requests.")
    timeout_s: float = Field(60, gt=0, description="Per-request timeout.")
    slo: SLO = SLO()

    @model_validator(mode="after")
    def _check(self) -> Scenario:
        names = [r.name for r in self.requests]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate request name in {names}")
        if self.wait_s[0] > self.wait_s[1]:
            raise ValueError("wait_s must be [min, max]")
        return self

    @property
    def duration_s(self) -> float:
        return sum(s.duration_s for s in self.shape)

    def scaled(self, duration_s: float | None) -> Scenario:
        """The same shape stretched or shrunk to ``duration_s`` in total (bursts keep their form)."""
        if not duration_s:
            return self
        k = duration_s / self.duration_s
        stages = [s.model_copy(update={"duration_s": s.duration_s * k}) for s in self.shape]
        return self.model_copy(update={"shape": stages})

    def with_model(self, model: str | None) -> Scenario:
        """Every request sent to ``model`` instead (e.g. the benchmark's single model)."""
        if not model:
            return self
        reqs = [r.model_copy(update={"model": model}) for r in self.requests]
        return self.model_copy(update={"requests": reqs})

    def users_at(self, t: float) -> tuple[int, float] | None:
        """(users, spawn_rate) wanted ``t`` seconds into the run; None when the run is over."""
        end = 0.0
        for s in self.shape:
            end += s.duration_s
            if t < end:
                return s.users, s.spawn_rate
        return None


def scenario_names() -> list[str]:
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.yaml"))


def _path(name_or_path: str | Path) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        return p
    return SCENARIO_DIR / f"{name_or_path}.yaml"


def load_scenario(name_or_path: str | Path) -> Scenario:
    """Load a scenario by name (``loadtests/scenarios/<name>.yaml``) or path."""
    p = _path(name_or_path)
    data = read_yaml(p, ScenarioError, f"no such scenario (known: {', '.join(scenario_names())})")
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        raise ScenarioError(validation_message(str(p), "scenario", exc, data)) from None
