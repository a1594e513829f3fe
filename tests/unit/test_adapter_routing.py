"""An adapter request sent to a base replica that no longer holds the adapter. The replica retired
it (slots full) and unregistered it ``UNLOAD_DELAY_S`` later, while the gateway could not read the
endpoint records, so its last read still lists the adapter there. vLLM answers such a request
with a 404 (``The model `sub@v1` does not exist.``). The gateway treats that answer, for adapter
requests only, as safe to send elsewhere: the replica is marked as not holding the adapter (not
as failed) and the request goes to another holder or through Serve's router, within the retry
budget. Any other engine answer still reaches the client once, unchanged. Loopback HTTP replicas;
Serve's handle is replaced."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp import web

from serving.contract import Endpoint, LeaseHint, Record
from serving.errors import Unavailable
from serving.gateway.relay import Upstream, UpstreamResult, forward
from serving.gateway.replicas import ReplicaFinder
from tests.support.loopback import http_replica
from tests.unit.test_endpoints import PassThrough

ANSWER = {"choices": [{"index": 0, "text": "2"}], "usage": {"prompt_tokens": 4, "completion_tokens": 1}}
APP = "calc--v1"


def engine(holds: set[str], hits: list[str], name: str) -> Any:
    """A base replica's vLLM: the base ``calc`` and the adapters in ``holds``, vLLM's 404 else."""

    async def handler(request: web.Request) -> web.Response:
        model = (await request.json())["model"]
        hits.append(name)
        if model != "calc" and model not in holds:
            message = f"The model `{model}` does not exist. Valid aliases: calc."
            err = {"error": {"message": message, "type": "NotFoundError", "param": "model", "code": 404}}
            return web.json_response(err, status=404)
        return web.json_response(ANSWER)

    return handler


class Serve:
    """Serve's handle for the base: every lease call (an adapter's: multiplexed) yields ``url``."""

    def __init__(self, url: str, replica: str) -> None:
        self.endpoint = Endpoint(url, "t", replica)
        self.calls: list[Any] = []

    def options(self, **kwargs: Any) -> Serve:
        self.calls.append(kwargs)
        return self

    @property
    def lease(self) -> Any:
        endpoint = self.endpoint

        class Call:
            def __init__(self) -> None:
                self.n = 0

            async def __anext__(self) -> Endpoint:
                self.n += 1
                if self.n > 1:  # the call stays open while the request runs
                    import asyncio

                    await asyncio.Event().wait()
                return endpoint

            def cancel(self) -> None:
                pass

        class Remote:
            @staticmethod
            def remote(hint: LeaseHint) -> Call:
                return Call()

        return Remote


async def _send(finder: ReplicaFinder, model: str, adapter: str | None, retries: int = 2) -> UpstreamResult:
    client = Upstream(16, 10.0)
    hint = LeaseHint(adapter=adapter)
    try:
        return await forward(
            client=client,
            leaser=lambda: finder.lease(APP, hint, 5.0),
            path="/v1/completions",
            body=json.dumps({"model": model, "prompt": "1+1=", "max_tokens": 1}).encode(),
            stream=False,
            request_id="rid",
            retries=retries,
            obs=PassThrough(),
        )
    finally:
        await client.aclose()


async def test_an_adapter_gone_from_its_replica_is_retried_through_the_lease_path() -> None:
    hits: list[str] = []
    async with (
        http_replica(engine(set(), hits, "r1")) as r1,
        http_replica(engine({"sub@v1"}, hits, "r2")) as r2,
    ):
        finder = ReplicaFinder(direct=True)
        assert finder.table is not None
        # the last read the gateway could make: r1 held sub@v1 then (it has unregistered it since)
        finder.table.update([Record(APP, "r1", r1, "t", 7, adapters=frozenset({"sub@v1"}))])
        serve = Serve(r2, "r2")
        finder._handles[APP] = serve  # type: ignore[assignment]
        result = await _send(finder, "sub@v1", "sub@v1")
        assert (result.status, result.replica, result.route, result.attempts) == (200, "r2", "serve", 2)
        assert hits == ["r1", "r2"] and serve.calls == [{"multiplexed_model_id": "sub@v1"}]
        # r1 is not a failed replica: the base's requests still go there, the adapter's do not
        assert finder.table.pick(APP).replica == "r1"  # type: ignore[union-attr]
        assert finder.table.pick(APP, adapter="sub@v1") is None
        finder.table.update([Record(APP, "r1", r1, "t", 7, adapters=frozenset({"sub@v1"}))])  # same record
        assert finder.table.pick(APP, adapter="sub@v1") is None
        finder.table.update([Record(APP, "r1", r1, "t", 8, adapters=frozenset({"sub@v1"}))])  # published again
        assert finder.table.pick(APP, adapter="sub@v1") is not None
        finder.stop()


async def test_another_holder_in_the_table_takes_the_retry_directly() -> None:
    hits: list[str] = []
    async with (
        http_replica(engine(set(), hits, "r1")) as r1,
        http_replica(engine({"sub@v1"}, hits, "r2")) as r2,
    ):
        finder = ReplicaFinder(direct=True)
        assert finder.table is not None
        held = frozenset({"sub@v1"})
        finder.table.update(
            [Record(APP, "r1", r1, "t", 1, adapters=held), Record(APP, "r2", r2, "t", 1, adapters=held)]
        )
        for _ in range(4):
            result = await _send(finder, "sub@v1", "sub@v1")
            assert (result.status, result.replica, result.route) == (200, "r2", "direct")
        assert hits.count("r1") <= 1  # asked once at most, then known not to hold it
        finder.stop()


@pytest.mark.parametrize(
    ("model", "adapter"),
    [
        ("sub@v1", None),  # the base's own request (no adapter named): the engine's answer stands
        ("other@v1", "sub@v1"),  # a 404 about another name than the lease's adapter
    ],
)
async def test_any_other_404_reaches_the_client_once_unchanged(model: str, adapter: str | None) -> None:
    hits: list[str] = []
    async with http_replica(engine(set(), hits, "r1")) as r1:
        finder = ReplicaFinder(direct=True)
        assert finder.table is not None
        finder.table.update([Record(APP, "r1", r1, "t", 1, adapters=frozenset({"sub@v1"}))])
        result = await _send(finder, model, adapter)
        assert result.status == 404 and result.attempts == 1 and hits == ["r1"]
        assert (
            result.body is not None
            and f"The model `{model}` does not exist" in json.loads(result.body)["error"]["message"]
        )
        assert finder.table.pick(APP, adapter="sub@v1") is not None  # nothing was marked
        finder.stop()


async def test_with_no_retry_left_the_client_is_told_to_retry() -> None:
    hits: list[str] = []
    async with http_replica(engine(set(), hits, "r1")) as r1:
        finder = ReplicaFinder(direct=True)
        assert finder.table is not None
        finder.table.update([Record(APP, "r1", r1, "t", 1, adapters=frozenset({"sub@v1"}))])
        with pytest.raises(Unavailable) as err:
            await _send(finder, "sub@v1", "sub@v1", retries=0)
        assert err.value.status == 503 and err.value.headers == {"retry-after": "1"} and hits == ["r1"]
        finder.stop()
