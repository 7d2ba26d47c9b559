"""One server per model kind, as vLLM: a generating model refuses the pooling endpoints naming
``--runner pooling``, a pooling model refuses the generation endpoints naming ``--runner
generate``, an embedder refuses /classify and a classifier /v1/embeddings naming ``--convert``;
each answer the OpenAI error object before any work, and the server goes on serving. The
routers' worker routes and API keys cover the pooling routes too."""

from __future__ import annotations

import openai
import pytest

from paged_serve.server.app import create_app
from tests.server.conftest import ServerThread, assert_error, http, metric_values
from tests.server.pooling.conftest import Served

POOLING_BODIES = {
    "/v1/embeddings": {"input": "w1"},
    "/pooling": {"input": "w1"},
    "/classify": {"input": "w1"},
    "/score": {"text_1": "w1", "text_2": "w2"},
    "/rerank": {"query": "w1", "documents": ["w2"]},
    "/v1/rerank": {"query": "w1", "documents": ["w2"]},
    "/v2/rerank": {"query": "w1", "documents": ["w2"]},
}
GENERATION_BODIES = {
    "/v1/completions": {"prompt": "w1", "max_tokens": 1},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "w1"}]},
    "/v1/responses": {"input": "w1"},
}


@pytest.mark.parametrize("path", sorted(POOLING_BODIES))
def test_a_generating_model_refuses_the_pooling_endpoints(generator: Served, path: str):
    reply = http("POST", f"{generator.url}{path}", json=POOLING_BODIES[path])
    error = assert_error(reply, 400)
    assert path in error["message"] and "--runner pooling" in error["message"]
    done = http("POST", f"{generator.url}/v1/completions", json={"prompt": "w1", "max_tokens": 2})
    assert done.status == 200, done.body  # it still generates


@pytest.mark.parametrize("path", sorted(GENERATION_BODIES))
def test_a_pooling_model_refuses_the_generation_endpoints(embedder: Served, path: str):
    for body in (GENERATION_BODIES[path], {"not": "even valid"}):  # answered before decoding
        error = assert_error(http("POST", f"{embedder.url}{path}", json=body), 400)
        assert path in error["message"] and "--runner generate" in error["message"]
    assert http("POST", f"{embedder.url}/v1/embeddings", json={"input": "w1"}).status == 200


def test_the_openai_sdk_sees_the_refusals(embedder: Served, generator: Served):
    pooled = openai.OpenAI(base_url=f"{embedder.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="--runner generate"):
        pooled.chat.completions.create(
            model=embedder.name, messages=[{"role": "user", "content": "w1"}]
        )
    generating = openai.OpenAI(base_url=f"{generator.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        generating.embeddings.create(model=generator.name, input="w1")


def test_embed_and_classify_models_refuse_each_others_endpoint(
    embedder: Served, classifier: Served
):
    error = assert_error(http("POST", f"{embedder.url}/classify", json={"input": "w1"}), 400)
    assert "--convert classify" in error["message"]
    reply = http("POST", f"{classifier.url}/v1/embeddings", json={"input": "w1"})
    assert "--convert embed" in assert_error(reply, 400)["message"]


def test_models_and_worker_routes_on_a_pooling_server(embedder: Served, generator: Served):
    models = http("GET", f"{embedder.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [embedder.name]
    assert http("GET", f"{embedder.url}/model_info").json()["is_generation"] is False
    assert http("GET", f"{generator.url}/model_info").json()["is_generation"] is True
    before = embedder.engine.stats.prompt_tokens_total
    assert http("GET", f"{embedder.url}/health_generate").status == 200  # a one-token pooling
    assert embedder.engine.stats.prompt_tokens_total == before + 1


def test_the_pooling_routes_need_an_api_key_when_the_server_has_keys(
    embedder: Served, server_thread: ServerThread
):
    url = server_thread.serve(lambda: create_app(embedder.engine, api_keys=("sk-pool",)))
    for path, body in POOLING_BODIES.items():
        assert_error(http("POST", f"{url}{path}", json=body), 401, code="invalid_api_key")
    keyed = {"Authorization": "Bearer sk-pool"}
    for path in ("/v1/embeddings", "/pooling", "/score", "/rerank", "/v2/rerank"):
        reply = http("POST", f"{url}{path}", json=POOLING_BODIES[path], headers=keyed)
        assert reply.status == 200, (path, reply.body)


def test_prefix_cache_hits_stay_within_a_key_and_salt(
    embedder: Served, server_thread: ServerThread
):
    """A decoder's last-token pooling takes prefix-cache hits; like generation's, they are
    scoped to the API key and ``cache_salt``, so their timing tells no key what another sent."""
    url = server_thread.serve(lambda: create_app(embedder.engine, api_keys=("sk-a", "sk-b")))
    text = " ".join(f"w{i}" for i in range(40, 80))  # 40 tokens: two full KV blocks

    def hits_after(key: str, **extra: object) -> float:
        body = {"input": text, **extra}
        reply = http(
            "POST", f"{url}/v1/embeddings", json=body, headers={"Authorization": f"Bearer {key}"}
        )
        assert reply.status == 200, reply.body
        return metric_values(url)["paged_serve_prefix_cache_hit_tokens_total"]

    start = hits_after("sk-a")
    assert hits_after("sk-a") == start + 32  # the same key: both full blocks hit
    assert hits_after("sk-b") == start + 32  # another key: none
    assert hits_after("sk-a", cache_salt="user-1") == start + 32  # another salt: none
    assert hits_after("sk-a", cache_salt="user-1") == start + 64
