"""Request bodies and streamed-response accounting, shared by the Locust users and the benchmark.

No Locust import here (Locust monkey-patches the standard library with gevent on import), so the
benchmark's asyncio client and the unit tests use the same code.

Timing definitions (the same in Locust reports, the benchmark and the gateway's own metrics):
- TTFT: request sent -> first SSE event that carries a choice (the first generated token; for
  chat the first event also carries the role, and vLLM sends it with the first token).
- ITL: per request, (last token event - first token event) / (completion tokens - 1).
- Tokens: ``usage.completion_tokens`` of the final usage event (``stream_options.include_usage``),
  else the number of token events.
"""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass, field
from typing import Any

from loadtests.scenario import RequestSpec, SharedPrefix

__all__ = [
    "Outcome",
    "RequestFactory",
    "StreamMeter",
    "completion_bodies",
    "outcome_of_body",
    "prompt_pool",
    "random_text",
    "shared_prefixes",
]

_ALPHABET = string.ascii_lowercase + "      "


def random_text(rng: random.Random, chars: int) -> str:
    """Lower-case words of random length, exactly ``chars`` characters long."""
    return "".join(rng.choice(_ALPHABET) for _ in range(chars))


def shared_prefixes(sp: SharedPrefix) -> list[str]:
    """The scenario's few long system prompts: deterministic, so every worker shares them."""
    rng = random.Random(sp.seed)
    return [f"system {i}: " + random_text(rng, max(0, sp.chars - 10)) for i in range(sp.count)]


class RequestFactory:
    """Builds request bodies for one :class:`RequestSpec` (fresh random fields each call)."""

    def __init__(self, spec: RequestSpec, rng: random.Random | None = None) -> None:
        self.spec = spec
        self.rng = rng or random.Random()
        self.prefixes = shared_prefixes(spec.shared_prefix) if spec.shared_prefix else []
        self.path = "/v1/chat/completions" if spec.endpoint == "chat" else "/v1/completions"

    def user_text(self) -> str:
        r = self.rng
        return self.spec.prompt.format(
            a=r.randint(10, 99), b=r.randint(10, 99), text=random_text(r, self.spec.user_chars)
        )

    def body(self) -> dict[str, Any]:
        s = self.spec
        prefix = self.rng.choice(self.prefixes) if self.prefixes else None
        user = self.user_text()
        out: dict[str, Any] = {"model": s.model, "max_tokens": s.max_tokens, "temperature": s.temperature}
        if s.endpoint == "chat":
            msgs = [{"role": "system", "content": prefix}] if prefix else []
            out["messages"] = [*msgs, {"role": "user", "content": user}]
        else:
            out["prompt"] = (prefix or "") + user
        if s.ignore_eos:
            out["ignore_eos"] = True
        if s.stream:
            out["stream"] = True
            out["stream_options"] = {"include_usage": True}
        return out


@dataclass
class Outcome:
    """One finished request."""

    ok: bool
    latency_s: float
    tokens: int = 0
    ttft_s: float | None = None
    itl_s: float | None = None
    error: str = ""
    prompt_tokens: int = 0


@dataclass
class StreamMeter:
    """Feed it the SSE lines of one streamed response (with the clock time each arrived)."""

    started: float
    first_at: float | None = None
    last_at: float | None = None
    events: int = 0
    usage: dict[str, Any] | None = None
    error: str = ""
    done: bool = False
    _errors: list[str] = field(default_factory=list)

    def line(self, line: str | bytes, now: float) -> None:
        if isinstance(line, bytes):
            line = line.decode("utf-8", "replace")
        if not line.startswith("data:"):
            return
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(data)
        except json.JSONDecodeError:
            self.error = self.error or f"unparsable SSE event: {data[:80]!r}"
            return
        if "error" in obj:
            err = obj["error"]
            self.error = str(err.get("message") if isinstance(err, dict) else err)[:200]
            return
        if obj.get("usage"):
            self.usage = obj["usage"]
        if obj.get("choices"):
            if self.first_at is None:
                self.first_at = now
            self.last_at = now
            self.events += 1

    def outcome(self, now: float) -> Outcome:
        tokens = int((self.usage or {}).get("completion_tokens") or self.events)
        prompt_tokens = int((self.usage or {}).get("prompt_tokens") or 0)
        error = self.error or ("" if self.done else "stream ended without [DONE]")
        ttft = None if self.first_at is None else self.first_at - self.started
        itl = None
        if self.first_at is not None and self.last_at is not None and tokens > 1:
            itl = (self.last_at - self.first_at) / (tokens - 1)
        return Outcome(not error, now - self.started, tokens, ttft, itl, error, prompt_tokens)


def outcome_of_body(status: int, body: bytes, started: float, now: float) -> Outcome:
    """A non-streamed response (or any error response) as an :class:`Outcome`."""
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        obj = {}
    if status != 200 or not isinstance(obj, dict) or "error" in obj:
        err = obj.get("error") if isinstance(obj, dict) else None
        msg = err.get("message") if isinstance(err, dict) else body[:120].decode("utf-8", "replace")
        return Outcome(False, now - started, error=f"HTTP {status}: {msg}"[:200])
    usage = obj.get("usage") or {}
    return Outcome(
        True,
        now - started,
        int(usage.get("completion_tokens") or 0),
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
    )


def prompt_pool(model_dir: str, tokens: int, n: int = 256, seed: int = 0) -> list[str]:
    """``n`` different random prompts of exactly ``tokens`` tokens (special tokens included) with
    the model's own tokenizer; distinct prompts keep prefix caching from skipping the prefill."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(seed)

    def count(s: str) -> int:
        return len(tok(s)["input_ids"])

    pool = []
    for _ in range(n):
        text = random_text(rng, tokens * 4)
        lo, hi = 1, len(text)
        while lo < hi:  # longest prefix with <= tokens tokens
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if count(text[:mid]) <= tokens else (lo, mid - 1)
        pool.append(text[:lo])
    return pool


def completion_bodies(model: str | list[str], prompts: list[Any], output_tokens: int) -> Any:
    """A body factory walking through ``prompts`` in order (one fresh factory per server, so
    every server gets the same sequence and, with a large enough pool, never a repeated prompt).
    ``model``: one name for every request, or a name per prompt (``model[i]`` with ``prompts[i]``)."""
    it = iter(range(1 << 62))
    names = [model] * len(prompts) if isinstance(model, str) else model

    def make() -> dict[str, Any]:
        i = next(it)
        return {
            "model": names[i % len(prompts)],
            "prompt": prompts[i % len(prompts)],
            "max_tokens": output_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    return make
