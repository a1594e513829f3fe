from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from serving.config import AuthConfig
from serving.errors import AuthenticationError, Unavailable
from serving.gateway.admission.auth import ANONYMOUS, Authenticator, hash_key, new_key
from serving.gateway.admission.quota import QuotaActor, QuotaClient, WindowCounter, rate_limit_headers
from tests.support.kv import MemoryKV


def test_hashed_and_env_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    k1, k2 = new_key(), new_key()
    monkeypatch.setenv("TEAM_B_KEY", k2)
    auth = Authenticator(
        AuthConfig.model_validate(
            {
                "mode": "keys",
                "tenants": [
                    {"name": "a", "key_hashes": [hash_key(k1)], "models": ["adder"], "rpm": 5},
                    {"name": "b", "key_env": "TEAM_B_KEY"},
                ],
            }
        )
    )
    assert auth.authenticate(f"Bearer {k1}").name == "a"
    assert auth.authenticate(f"Bearer {k1}").name == "a"  # cached path
    assert auth.authenticate(f"bearer {k2}").name == "b"
    assert auth.authenticate(f"Bearer {k1}").allows("adder")
    assert not auth.authenticate(f"Bearer {k1}").allows("subtractor")
    for bad in (None, "", "Basic x", f"Bearer {k1}x", "Bearer "):
        with pytest.raises(AuthenticationError):
            auth.authenticate(bad)


def _tenants(*tenants: dict[str, Any], mode: str = "keys") -> AuthConfig:
    return AuthConfig.model_validate({"mode": mode, "tenants": list(tenants)})


@pytest.mark.parametrize("how", ["env_and_env", "env_and_hash", "hash_and_env"])
def test_a_key_of_two_tenants_is_refused_at_start_naming_them_never_the_key(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two variables holding one value, or a variable holding a key another tenant's hash
    verifies: which tenant it authenticates as would depend on the order of the checks."""
    key = new_key()
    monkeypatch.setenv("TEAM_A_KEY", key)
    monkeypatch.setenv("TEAM_B_KEY", key + "\n")  # a Secret made from a file: the same key
    a = {"name": "a", "models": ["small"], "rpm": 5}
    b = {"name": "b", "models": ["*"]}
    a |= {"key_hashes": [hash_key(key)]} if how == "hash_and_env" else {"key_env": "TEAM_A_KEY"}
    b |= {"key_hashes": [hash_key(key)]} if how == "env_and_hash" else {"key_env": "TEAM_B_KEY"}
    with pytest.raises(ValueError, match="tenants 'a' .* and 'b' .* have the same API key") as exc:
        Authenticator(_tenants(a, b))
    assert key not in str(exc.value) and key[-12:] not in str(exc.value)


def test_keys_of_one_tenant_may_repeat_and_open_mode_checks_none(monkeypatch: pytest.MonkeyPatch) -> None:
    key, other = new_key(), new_key()
    monkeypatch.setenv("TEAM_A_KEY", key)
    monkeypatch.setenv("TEAM_B_KEY", other)
    auth = Authenticator(
        _tenants(
            {"name": "a", "key_env": "TEAM_A_KEY", "key_hashes": [hash_key(key)]},
            {"name": "b", "key_env": "TEAM_B_KEY"},
        )
    )
    assert auth.authenticate(f"Bearer {key}").name == "a" and auth.authenticate(f"Bearer {other}").name == "b"
    monkeypatch.setenv("TEAM_B_KEY", key)
    shared = _tenants({"name": "a", "key_env": "TEAM_A_KEY"}, {"name": "b", "key_env": "TEAM_B_KEY"}, mode="open")
    assert Authenticator(shared).authenticate(None) is ANONYMOUS  # no key is ever checked


def test_hash_is_salted_and_not_the_key() -> None:
    k = new_key()
    h1, h2 = hash_key(k), hash_key(k)
    assert h1 != h2 and k not in h1 and h1.startswith("sha256$")


def test_open_mode_is_anonymous() -> None:
    assert Authenticator(AuthConfig(mode="open")).authenticate(None) is ANONYMOUS


def test_window_counter_requests_and_tokens() -> None:
    c = WindowCounter()
    got = [c.admit("t", 3, None, 10, now=100.0 + i).allowed for i in range(5)]
    assert got == [True, True, True, False, False]
    a = c.admit("t", 3, None, 10, now=109.5)
    assert not a.allowed and a.reason == "requests" and a.reset_s == pytest.approx(0.5)
    assert c.admit("t", 3, None, 10, now=110.0).allowed  # next window
    assert c.admit("other", 3, None, 10, now=100.0).allowed  # tenants are separate
    c.record("u", 50, 10, now=200.0)
    assert c.admit("u", None, 60, 10, now=201.0).allowed
    c.record("u", 20, 10, now=202.0)
    b = c.admit("u", None, 60, 10, now=203.0)
    assert not b.allowed and b.reason == "tokens" and b.remaining_tokens == 0
    h = rate_limit_headers(b)
    assert h["x-ratelimit-limit-tokens"] == "60" and h["x-ratelimit-reset-tokens"] == "7s"


def test_token_reservations_bound_concurrent_overshoot_and_are_settled() -> None:
    c = WindowCounter()
    # 10 concurrent requests of up to 20 tokens against a TPM of 60: admitted while used plus
    # reserved is below the limit, so at most 3 (60 + one reservation at worst)
    got = [c.admit("t", None, 60, 10, now=100.0, reserve=20) for _ in range(10)]
    admitted = [a for a in got if a.allowed]
    assert len(admitted) == 3 and all(a.ticket for a in admitted)
    assert got[3].reason == "tokens" and got[3].remaining_tokens == 0
    for a in admitted:  # each used 5 of its 20: the rest is given back
        c.record("t", 5, 10, now=101.0, ticket=a.ticket)
    a = c.admit("t", None, 60, 10, now=102.0, reserve=20)
    assert a.allowed and a.remaining_tokens == 60 - 15 - 20
    # a reservation never settled (its gateway died) lapses
    short = WindowCounter(hold_s=5)
    assert short.admit("u", None, 10, 1000, now=0.0, reserve=10).allowed
    assert not short.admit("u", None, 10, 1000, now=1.0, reserve=10).allowed
    assert short.admit("u", None, 10, 1000, now=6.0, reserve=10).allowed


def test_quota_actor_counts_survive_a_restart_through_its_checkpoint() -> None:
    kv = MemoryKV()
    first = QuotaActor(kv, checkpoint_s=0)
    assert [first.admit("t", 2, None, 3600).allowed for _ in range(2)] == [True, True]
    held = first.admit("u", None, 100, 3600, reserve=40)
    assert first.checkpoint() and not first.checkpoint()  # written once, then nothing new
    again = QuotaActor(kv, checkpoint_s=0)  # what Ray's restart runs
    assert not again.admit("t", 2, None, 3600).allowed
    assert again.admit("u", None, 100, 3600, reserve=40).remaining_tokens == 100 - 80
    again.record("u", 10, 3600, ticket=held.ticket)
    assert again.admit("u", None, 100, 3600).remaining_tokens == 100 - 10 - 40


def test_tickets_issued_after_a_restart_are_new_and_only_their_tenant_settles_them() -> None:
    kv = MemoryKV()
    first = QuotaActor(kv, checkpoint_s=0)
    first.admit("x", None, 1000, 60, 100, True, 1)
    assert first.checkpoint()
    lost = first.admit("a", None, 1000, 60, 500, True, 1)  # admitted after the last checkpoint
    again = QuotaActor(kv, checkpoint_s=0)  # what Ray's restart runs
    b = again.admit("b", None, 1000, 60, 500, True, 1)  # another tenant's stream, still running
    assert b.allowed and b.ticket not in (0, lost.ticket)
    again.record("a", 0, 60, ticket=lost.ticket)  # a's request ends and settles its ticket
    again.record("a", 0, 60, ticket=b.ticket)  # even naming b's ticket: not a's to settle
    assert again.counter.streams("b") == 1 and again.counter.reserved("b", time.time()) == 500
    assert again.admit("b", None, 1000, 60, 500, True, 1).reason == "streams"  # max_streams holds
    again.record("b", 0, 60, ticket=b.ticket)
    assert again.counter.streams("b") == 0 and again.counter.reserved("b", time.time()) == 0


def test_a_ticket_restored_from_a_checkpoint_is_held_minutes_not_an_hour() -> None:
    kv = MemoryKV()
    first = QuotaActor(kv, checkpoint_s=0)
    ended = first.admit("c", None, None, 60, 0, True, 1)
    running = first.admit("d", None, 1000, 60, 500, True, 1)
    assert first.checkpoint()
    first.record("c", 0, 60, ticket=ended.ticket)  # the stream ends; the actor dies before its next checkpoint
    again = QuotaActor(kv, checkpoint_s=0)
    now = time.time()
    # both restored (either may be a stream still running): held, and the running one is settled as usual
    assert again.counter.streams("c") == 1 and again.admit("c", None, None, 60, 0, True, 1).reason == "streams"
    again.record("d", 10, 60, ticket=running.ticket)
    assert again.counter.streams("d") == 0 and again.counter.reserved("d", now) == 0
    # the one whose settle call was lost goes within minutes (RESTORED_HOLD_S), not after hold_s (an hour)
    later = now + 600
    assert again.counter.admit("c", None, None, 60, later, stream=True, max_streams=1).allowed
    # a ticket issued since is held the whole hold_s
    assert again.counter.admit("c", None, None, 60, later + 600, stream=True, max_streams=1).reason == "streams"


class _Call:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


class _Unanswering:
    """An actor handle whose calls never complete (a hung or restarting actor)."""

    def __init__(self) -> None:
        self.admit = _Call(lambda *a: asyncio.get_running_loop().create_future())
        self.record = _Call(lambda *a: None)


class _Late:
    """A real quota actor in process whose admissions land ``delay_s`` late (a restarting or
    overloaded actor: Ray runs a queued call after the caller stopped waiting)."""

    def __init__(self, delay_s: float) -> None:
        self.actor = QuotaActor(MemoryKV(), checkpoint_s=0)

        async def run(*args: Any) -> Any:
            await asyncio.sleep(delay_s)
            return self.actor.admit(*args)

        # like an ObjectRef: the call runs whether or not its caller still waits for it
        self.admit = _Call(lambda *args: asyncio.shield(asyncio.ensure_future(run(*args))))
        self.record = _Call(lambda *args: self.actor.record(*args))


@pytest.mark.parametrize("left", ["timeout", "client_left"])
async def test_an_admission_that_lands_after_the_gateway_stopped_waiting_is_given_back(left: str) -> None:
    late = _Late(0.3)
    client = QuotaClient(3600, late, timeout_s=0.1 if left == "timeout" else 5)
    waiting = asyncio.ensure_future(client.admit("t", None, 1000, reserve=600, stream=True, max_streams=1))
    if left == "timeout":
        assert await waiting == ({}, 0)  # failed open
    else:
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
    await asyncio.sleep(0.5)  # the actor admits late; the client settles that at once
    counter = late.actor.counter
    assert counter.reserved("t", time.time()) == 0 and counter.streams("t") == 0
    # the tenant still has its whole TPM and its one stream
    assert late.actor.admit("t", None, 1000, 3600, 600, True, 1).allowed


@pytest.mark.parametrize("mode", ["open", "closed"])
async def test_an_unanswering_quota_actor_fails_open_or_closed_in_bounded_time(mode: str) -> None:
    client = QuotaClient(10, _Unanswering(), timeout_s=0.2, failure_mode=mode)
    if mode == "open":
        assert await asyncio.wait_for(client.admit("t", 5, None), 2) == ({}, 0)
    else:
        with pytest.raises(Unavailable) as exc:
            await asyncio.wait_for(client.admit("t", 5, None), 2)
        assert exc.value.status == 503 and exc.value.headers["retry-after"] == "1"
    assert client.failures == 1
