"""The APIs agent clients speak, through the official ``openai`` and ``anthropic`` SDKs against the
integration stack: OpenAI's Responses (conversation state the gateway owns), Anthropic's Messages,
vLLM's tokenize, with the stack's tenants, keys and limits. The models are tiny and trained on
arithmetic only, so the checks are on protocol, shape, usage and state, not on answer quality."""

from __future__ import annotations

import time
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.conftest import Stack
from tests.integration.raytools import ray_run

pytestmark = pytest.mark.integration

WINDOW = 10.0  # auth.window_s in tests/integration/stack.yaml
ANTHROPIC_ERROR = {"type", "error"}


def _post(url: str, **kw: Any) -> httpx.Response:
    return httpx.post(url, timeout=60, **kw)


def _get(url: str, **kw: Any) -> httpx.Response:
    return httpx.get(url, timeout=60, **kw)


def _fresh_window() -> None:
    time.sleep(WINDOW - time.time() % WINDOW + 0.05)


@pytest.fixture(scope="module")
def oai(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.keys["main"], max_retries=0)


def _claude(stack: Stack, tenant: str = "main", bearer: bool = False) -> anthropic.Anthropic:
    key = stack.keys[tenant]
    if bearer:
        return anthropic.Anthropic(base_url=stack.url, auth_token=key, api_key=None, max_retries=0)
    return anthropic.Anthropic(base_url=stack.url, api_key=key, max_retries=0)


def _anthropic_error(body: Any, type_: str) -> None:
    assert isinstance(body, dict) and set(body) == ANTHROPIC_ERROR and body["type"] == "error", body
    assert body["error"]["type"] == type_ and body["error"]["message"], body


# -- Responses ---------------------------------------------------------------------------------


def test_responses_create_stream_retrieve_delete(oai: openai.OpenAI) -> None:
    r = oai.responses.create(model="subtractor", input="50-8=", max_output_tokens=6, temperature=0)
    assert r.object == "response" and r.status in ("completed", "incomplete") and r.id.startswith("resp_")
    assert r.usage is not None and r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert isinstance(r.output_text, str)
    got = oai.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.usage == r.usage

    deltas: list[str] = []
    final = None
    with oai.responses.create(
        model="subtractor", input="71-9=", max_output_tokens=6, temperature=0, stream=True
    ) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            elif event.type in ("response.completed", "response.incomplete"):
                final = event.response
    assert final is not None and final.usage is not None and final.usage.output_tokens > 0
    assert final.store is True  # the client's setting, though the engine was sent store: false
    streamed = oai.responses.retrieve(final.id)  # stored before the stream's last byte
    assert streamed.output_text == "".join(deltas) == final.output_text

    oai.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError):  # a finished response cannot be cancelled
        oai.responses.cancel(final.id)


def test_a_follow_up_is_expanded_by_the_gateway_and_served_by_another_replica(oai: openai.OpenAI) -> None:
    """adder has two replicas and session affinity: session ids pick the replica."""
    first = oai.responses.with_raw_response.create(
        model="adder", input="12+30=", max_output_tokens=4, temperature=0, extra_headers={"x-session-id": "s0"}
    )
    r1 = first.parse()
    assert r1.usage is not None
    seen = first.headers["x-replica"]
    for i in range(1, 12):
        raw = oai.responses.with_raw_response.create(
            model="adder",
            input="and 5+5=",
            previous_response_id=r1.id,
            max_output_tokens=4,
            temperature=0,
            extra_headers={"x-session-id": f"s{i}"},
        )
        if raw.headers["x-replica"] != seen:
            break
    else:
        pytest.fail("every follow-up landed on the first response's replica")
    r2 = raw.parse()
    assert r2.previous_response_id == r1.id and r2.usage is not None
    # the other gateway replica (each new connection may land on either) answers from the same store
    for _ in range(20):
        got = _get(f"{oai.base_url}responses/{r1.id}", headers={"authorization": f"Bearer {oai.api_key}"})
        if got.headers["x-gateway-replica"] != first.headers["x-gateway-replica"]:
            break
    else:
        pytest.fail("every retrieval reached the gateway replica that stored the response")
    assert got.status_code == 200 and got.json()["id"] == r1.id
    # the history (first input and output) went to the other replica as input items
    assert r2.usage.input_tokens > r1.usage.input_tokens + r1.usage.output_tokens
    assert oai.responses.retrieve(r2.id).previous_response_id == r1.id


RESTART = """
import time
ray.kill(ray.get_actor("raystack-responses"), no_restart=False)
deadline = time.time() + 30
while time.time() < deadline:
    try:
        ray.get(ray.get_actor("raystack-responses").get.remote("probe", "none"), timeout=2)
        break
    except Exception:
        time.sleep(0.2)
print(json.dumps(True))
"""


def test_stored_responses_survive_a_restart_of_the_store(oai: openai.OpenAI, stack: Stack) -> None:
    r = oai.responses.create(model="subtractor", input="50-8=", max_output_tokens=4)
    assert ray_run(stack, RESTART)
    assert oai.responses.retrieve(r.id).output_text == r.output_text  # reloaded from Ray's key-value store
    follow = oai.responses.create(model="subtractor", input="9-1=", previous_response_id=r.id, max_output_tokens=2)
    assert follow.previous_response_id == r.id


def test_store_false_is_not_retrievable_and_unknown_ids_are_404(oai: openai.OpenAI, stack: Stack) -> None:
    r = oai.responses.create(model="subtractor", input="9-3=", max_output_tokens=3, store=False)
    for rid in (r.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError) as exc:
            oai.responses.retrieve(rid)
        assert set(exc.value.body) == {"message", "type", "param", "code"}  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="subtractor", input="1-1=", previous_response_id=r.id, max_output_tokens=2)


def test_another_tenants_response_id_is_404(oai: openai.OpenAI, stack: Stack) -> None:
    mine = oai.responses.create(model="adder", input="1+2=", max_output_tokens=3)
    other = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.keys["limited"], max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model="adder", input="3+3=", previous_response_id=mine.id, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError) as exc:  # a model outside its list
        other.responses.create(model="subtractor", input="3-3=", max_output_tokens=2)
    assert exc.value.code == "model_not_found"


# -- Anthropic Messages ------------------------------------------------------------------------


@pytest.mark.parametrize("bearer", [False, True], ids=["x-api-key", "bearer"])
def test_messages_create_and_stream(stack: Stack, bearer: bool) -> None:
    claude = _claude(stack, bearer=bearer)
    m = claude.messages.create(model="subtractor", max_tokens=6, messages=[{"role": "user", "content": "50-8="}])
    assert m.type == "message" and m.role == "assistant" and m.content and m.content[0].type == "text"
    assert m.usage.input_tokens > 0 and m.usage.output_tokens > 0
    with claude.messages.stream(
        model="subtractor", max_tokens=6, messages=[{"role": "user", "content": "71-9="}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.content[0].type == "text" and final.content[0].text == text
    assert final.usage.output_tokens > 0
    n = claude.messages.count_tokens(model="subtractor", messages=[{"role": "user", "content": "50-8="}])
    assert n.input_tokens > 0


def test_messages_errors_are_in_anthropics_shape(stack: Stack) -> None:
    msg = [{"role": "user", "content": "1+1="}]
    bad = anthropic.Anthropic(base_url=stack.url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as auth:
        bad.messages.create(model="adder", max_tokens=2, messages=msg)  # type: ignore[arg-type]
    _anthropic_error(auth.value.body, "authentication_error")
    limited = _claude(stack, "limited")
    with pytest.raises(anthropic.NotFoundError) as missing:
        limited.messages.create(model="subtractor", max_tokens=2, messages=msg)  # type: ignore[arg-type]
    _anthropic_error(missing.value.body, "not_found_error")
    r = _post(f"{stack.url}/v1/messages", json={"model": "adder", "messages": msg}, headers=stack.headers())
    assert r.status_code == 400
    _anthropic_error(r.json(), "invalid_request_error")  # max_tokens is required
    engine = _post(  # vLLM's own 400 (an unknown role), normalised to the same shape
        f"{stack.url}/v1/messages",
        json={"model": "adder", "max_tokens": 2, "messages": [{"role": "robot", "content": "x"}]},
        headers=stack.headers(),
    )
    assert engine.status_code == 400
    _anthropic_error(engine.json(), "invalid_request_error")


def test_limits_apply_to_the_agent_apis(stack: Stack) -> None:
    """RPM on Messages and count_tokens (limited: 4 per window); TPM billed with every usage field
    Messages reports (tokens: 60 per window), while tokenize and count_tokens count no tokens."""
    _fresh_window()
    msg = [{"role": "user", "content": "12+30="}]
    limited = _claude(stack, "limited")
    for _ in range(4):
        limited.messages.count_tokens(model="adder", messages=msg)  # type: ignore[arg-type]
    with pytest.raises(anthropic.RateLimitError) as rl:
        limited.messages.create(model="adder", max_tokens=2, messages=msg)  # type: ignore[arg-type]
    _anthropic_error(rl.value.body, "rate_limit_error")
    assert rl.value.response.headers["retry-after"]

    _fresh_window()
    tokens = _claude(stack, "tokens")
    used = 0
    for _ in range(12):
        try:
            m = tokens.messages.create(model="adder", max_tokens=4, messages=msg)  # type: ignore[arg-type]
        except anthropic.RateLimitError as exc:
            _anthropic_error(exc.body, "rate_limit_error")
            break
        u = m.usage
        used += u.input_tokens + u.output_tokens
        used += (u.cache_creation_input_tokens or 0) + (u.cache_read_input_tokens or 0)
    else:
        pytest.fail("TPM never refused a Messages request")
    assert 60 <= used < 60 + 30
    # requests that generate nothing still pass: they count against RPM only (tokens has none)
    assert tokens.messages.count_tokens(model="adder", messages=msg).input_tokens > 0  # type: ignore[arg-type]
    t = _post(f"{stack.url}/tokenize", json={"model": "adder", "prompt": "12+30="}, headers=stack.headers("tokens"))
    assert t.status_code == 200, t.text
    responses = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.keys["tokens"], max_retries=0)
    with pytest.raises(openai.RateLimitError):
        responses.responses.create(model="adder", input="1+1=", max_output_tokens=2)


# -- tokenize, models ----------------------------------------------------------------------------


def test_tokenize_round_trip_and_model_list(stack: Stack) -> None:
    h = stack.headers()
    t = _post(f"{stack.url}/tokenize", json={"model": "subtractor", "prompt": "50-8="}, headers=h)
    assert t.status_code == 200 and t.json()["count"] == len(t.json()["tokens"]) > 0
    d = _post(f"{stack.url}/detokenize", json={"model": "subtractor", "tokens": t.json()["tokens"]}, headers=h)
    assert d.status_code == 200 and "50-8=" in d.json()["prompt"]
    other = _post(
        f"{stack.url}/tokenize", json={"model": "subtractor", "prompt": "1"}, headers=stack.headers("limited")
    )
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
    cards = _get(f"{stack.url}/v1/models", headers=h).json()["data"]
    by_id = {c["id"]: c for c in cards}
    now = time.time()
    for cid in ("adder", "adder@v1", "subtractor@v1"):
        assert 1_700_000_000 < by_id[cid]["created"] <= now, by_id[cid]  # the version's manifest time
        assert {"chat", "completions", "responses", "messages"} <= set(by_id[cid]["capabilities"])
    assert by_id["adder"]["created"] == by_id["adder@v1"]["created"]
