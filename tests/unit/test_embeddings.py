"""Pooling (embedding) models: the config field, the engine's command line, the wire checks, and
the gateway refusing a request of the other kind from the config (a real HTTP replica on loopback
behind the real gateway app counts what reached it)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

import httpx
import pytest
from aiohttp import web

from loadtests.relay import OneReplica
from serving.config import ConfigError, EngineConfig, GatewayConfig, parse_config
from serving.control.serve_config import routing_user_config
from serving.errors import InvalidRequest
from serving.gateway.admission.auth import tenant_cache_salt
from serving.gateway.api import create_api
from serving.gateway.core import GatewayCore
from serving.gateway.protocol import parse_request
from serving.metrics import GatewayMetrics
from serving.replica.engine import EngineSpec, engine_args, vllm_command
from tests.support.loopback import http_replica


def _stack(**engine: object) -> dict[str, object]:
    return {
        "auth": {"mode": "open"},
        "models": [
            {"name": "chat", "versions": [{"version": "v1"}]},
            {"name": "embed", "engine": {"runner": "pooling", **engine}, "versions": [{"version": "v1"}]},
        ],
    }


def test_runner_defaults_to_generate_and_reaches_the_command_line() -> None:
    assert EngineConfig().runner == "generate"
    spec = EngineSpec(model="e", version="v1", path="/p", engine=EngineConfig(runner="pooling", dtype="float32"))
    cmd = vllm_command(spec, "127.0.0.1", 9000)
    assert cmd[cmd.index("--runner") + 1] == "pooling"
    assert engine_args(spec)["runner"] == "pooling"
    # vLLM warns that forcing prefix caching on a bidirectional pooling model may give wrong outputs
    assert "enable_prefix_caching" not in engine_args(spec) and "--enable-prefix-caching" not in cmd
    plain = vllm_command(EngineSpec(model="c", version="v1", path="/p", engine=EngineConfig()), "127.0.0.1", 9000)
    assert plain[plain.index("--runner") + 1] == "generate" and "--enable-prefix-caching" in plain


def test_vllm_parses_the_pooling_command() -> None:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    spec = EngineSpec(model="e", version="v1", path="/p", engine=EngineConfig(runner="pooling"))
    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(vllm_command(spec, "127.0.0.1", 8000)[2:])
    assert ns.runner == "pooling"


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        ({"extra_args": {"runner": "generate"}}, "use the runner field"),
        ({"extra_args": {"convert": "embed"}}, "use the runner field"),
        ({"tool_call_parser": "hermes"}, "tool_call_parser needs runner generate"),
        ({"runner": "embed"}, "runner"),
    ],
)
def test_invalid_pooling_configs_name_the_field(engine: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config(_stack(**engine))
    assert "models[embed].engine" in str(exc.value) and message in str(exc.value)


def test_the_gateway_learns_each_models_runner_from_the_config() -> None:
    routes = routing_user_config(parse_config(_stack()))
    assert {m["name"]: m["runner"] for m in routes["models"]} == {"chat": "generate", "embed": "pooling"}
    caps = {m["name"]: m["capabilities"] for m in routes["models"]}  # what /v1/models shows
    assert caps["embed"] == ["embeddings", "tokenize"] and "embeddings" not in caps["chat"]


def _e(body: object) -> object:
    return parse_request(json.dumps(body).encode(), "embedding")


@pytest.mark.parametrize(("inp", "prompt"), [("a cat sits", 14), (["a", "b"], 10), ([1, 2, 3], 3), ([[1, 2], [3]], 3)])
def test_embedding_inputs_in_openais_four_forms(inp: object, prompt: int) -> None:
    p = _e({"model": "embed", "input": inp})
    # its input is all prompt: reserved as such (text: its bytes and 4 special tokens; ids: their count)
    assert p.kind == "embedding" and not p.stream and p.reserve_tokens(256) == (prompt, 0)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "e"}, "input"),
        ({"model": "e", "input": ""}, "input"),
        ({"model": "e", "input": []}, "input"),
        ({"model": "e", "input": ["a", 1]}, "input"),
        ({"model": "e", "input": [[1], []]}, "input"),
        ({"model": "e", "input": [True]}, "input"),
        ({"model": "e", "input": {"text": "a"}}, "input"),
        ({"model": "e", "input": "a", "stream": True}, "stream"),
    ],
)
def test_invalid_embedding_bodies(body: object, param: str) -> None:
    with pytest.raises(InvalidRequest) as exc:
        _e(body)
    assert exc.value.param == param


@contextlib.asynccontextmanager
async def _gateway(url: str) -> AsyncIterator[httpx.AsyncClient]:
    core = GatewayCore(GatewayConfig(), OneReplica(url), metrics=GatewayMetrics())  # Ray's own counters
    core.reconfigure(routing_user_config(parse_config(_stack())))
    transport = httpx.ASGITransport(app=create_api(core, set_request_id_header=True))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=20) as c:
            yield c
    finally:
        await core.aclose()


EMBEDDING = {"object": "list", "data": [{"index": 0, "embedding": [0.6, 0.8]}], "usage": {"prompt_tokens": 5}}


async def test_embeddings_are_forwarded_and_a_request_of_the_other_kind_is_a_400_the_engine_never_sees() -> None:
    hits: list[dict[str, object]] = []

    async def handler(request: web.Request) -> web.Response:
        hits.append(await request.json())
        return web.json_response({**EMBEDDING, "model": hits[-1]["model"]})

    chat = {"model": "embed", "messages": [{"role": "user", "content": "x"}]}
    async with http_replica(handler, path="/v1/embeddings") as url, _gateway(url) as c:
        ok = await c.post("/v1/embeddings", json={"model": "embed@v1", "input": "a cat sits"})
        wrong = [
            await c.post("/v1/embeddings", json={"model": "chat", "input": "a cat sits"}),
            await c.post("/v1/chat/completions", json=chat),
            await c.post("/v1/completions", json={"model": "embed", "prompt": "x"}),
        ]
        unknown = await c.post("/v1/embeddings", json={"model": "nope", "input": "x"})
    assert ok.status_code == 200 and ok.json()["data"][0]["embedding"] == [0.6, 0.8]
    forwarded = {"model": "embed", "input": "a cat sits", "cache_salt": tenant_cache_salt("anonymous")}
    assert ok.headers["x-model-version"] == "v1" and hits == [forwarded]
    for r in wrong:
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "model_not_supported" and err["param"] == "model", r.text
        assert err["type"] == "invalid_request_error" and set(err) == {"message", "type", "param", "code"}
    assert "does not support embeddings" in wrong[0].json()["error"]["message"]
    assert "/v1/chat/completions" in wrong[1].json()["error"]["message"]
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert len(hits) == 1
