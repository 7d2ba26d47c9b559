"""Bad input to the pooling endpoints: each a 4xx OpenAI error object naming the field, after
which a good request still works and the engine's block pool is intact (checked after every
scenario, besides ``pools_clean`` after every test). And the engine requests of one call:
started together, cancelled together when one fails or the client goes away."""

from __future__ import annotations

import asyncio

import aiohttp
import numpy as np
import pytest

from paged_serve.engine.outputs import RequestOutput
from paged_serve.server.protocol.pooling import MAX_POOLING_INPUTS
from tests.server.conftest import assert_error, http
from tests.server.pooling.conftest import MAX_MODEL_LEN, Served, check_pool

LONG = " ".join(f"w{i % 100}" for i in range(MAX_MODEL_LEN + 5))  # one token a word

# (path, body, status, param, code)
SCENARIOS = {
    "empty list": ("/v1/embeddings", {"input": []}, 400, "input", None),
    "empty string": ("/v1/embeddings", {"input": ""}, 400, "input", None),
    "empty string in a list": ("/v1/embeddings", {"input": ["w1", ""]}, 400, "input[1]", None),
    "empty id list": ("/v1/embeddings", {"input": [[1], []]}, 400, "input", None),
    "mixed list": ("/v1/embeddings", {"input": ["w1", [1]]}, 400, "input", None),
    "negative id": ("/v1/embeddings", {"input": [3, -1]}, 400, "input[1]", None),
    "id outside the vocabulary": ("/v1/embeddings", {"input": [[5, 99999]]}, 400, "input", None),
    "too many inputs": (
        "/v1/embeddings",
        {"input": ["w1"] * (MAX_POOLING_INPUTS + 1)},
        400,
        "input",
        None,
    ),
    "over-long input": ("/v1/embeddings", {"input": LONG}, 400, "input", "context_length_exceeded"),
    "over-long among several": (
        "/v1/embeddings",
        {"input": ["w1", LONG]},
        400,
        "input[1]",
        "context_length_exceeded",
    ),
    "truncation past the context": (
        "/v1/embeddings",
        {"input": "w1", "truncate_prompt_tokens": MAX_MODEL_LEN + 1},
        400,
        "truncate_prompt_tokens",
        None,
    ),
    "truncation to nothing": (
        "/v1/embeddings",
        {"input": "w1", "truncate_prompt_tokens": 0},
        400,
        "truncate_prompt_tokens",
        None,
    ),
    "dimensions, not Matryoshka": (
        "/v1/embeddings",
        {"input": "w1", "dimensions": 8},
        400,
        "dimensions",
        None,
    ),
    "unknown encoding": (
        "/v1/embeddings",
        {"input": "w1", "encoding_format": "int8"},
        400,
        "encoding_format",
        None,
    ),
    "unknown model": ("/v1/embeddings", {"input": "w1", "model": "gpt-x"}, 404, "model", None),
    "not JSON": ("/v1/embeddings", b"{", 400, None, None),
    "pooling, empty": ("/pooling", {"input": []}, 400, "input", None),
    "score, no text_1": ("/score", {"text_2": "w1"}, 400, "text_1", None),
    "score, over-long pair": (
        "/score",
        {"text_1": "w1", "text_2": ["w2", LONG]},
        400,
        "text_2[1]",
        "context_length_exceeded",
    ),
    "score, over-long text_1 of several": (
        "/score",
        {"text_1": ["w1", LONG], "text_2": ["w2", "w3"]},
        400,
        "text_1[1]",
        "context_length_exceeded",
    ),
    "score, mismatched lists": (
        "/score",
        {"text_1": ["w1", "w2"], "text_2": ["w2", "w3", "w4"]},
        400,
        "text_2",
        None,
    ),
    "rerank, no documents": ("/rerank", {"query": "w1", "documents": []}, 400, "documents", None),
    "rerank, negative top_n": (
        "/rerank",
        {"query": "w1", "documents": ["w2"], "top_n": -1},
        400,
        "top_n",
        None,
    ),
    "rerank, too many documents": (
        "/v1/rerank",
        {"query": "w1", "documents": ["w2"] * (MAX_POOLING_INPUTS + 1)},
        400,
        "documents",
        None,
    ),
    "rerank, unknown model": (
        "/v2/rerank",
        {"query": "w1", "documents": ["w2"], "model": "other"},
        404,
        "model",
        None,
    ),
}
CODES = {"unknown model": "model_not_found", "rerank, unknown model": "model_not_found"}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_bad_input_is_refused_and_the_server_goes_on(embedder: Served, name: str):
    path, body, status, param, code = SCENARIOS[name]
    if isinstance(body, bytes):
        headers = {"Content-Type": "application/json"}
        reply = http("POST", f"{embedder.url}{path}", data=body, headers=headers)
    else:
        reply = http("POST", f"{embedder.url}{path}", json=body)
    assert_error(reply, status, param=param, code=code or CODES.get(name))
    check_pool(embedder.engine)
    good = http("POST", f"{embedder.url}{path}", json=_good(path))
    assert good.status == 200, good.body
    check_pool(embedder.engine)


def _good(path: str) -> dict:
    if path == "/score":
        return {"text_1": "w1", "text_2": ["w2", "w3"]}
    if "rerank" in path:
        return {"query": "w1", "documents": ["w2", "w3"]}
    return {"input": ["w1 w2", "w3"]}


def test_over_long_input_message_names_the_context(embedder: Served):
    error = assert_error(
        http("POST", f"{embedder.url}/v1/embeddings", json={"input": LONG}),
        400,
        param="input",
        code="context_length_exceeded",
    )
    assert f"context is {MAX_MODEL_LEN} tokens" in error["message"]
    assert "truncate_prompt_tokens" in error["message"]


def test_truncate_prompt_tokens_keeps_the_last_tokens(embedder: Served):
    ids = embedder.engine.tokenizer(LONG).input_ids

    def embed(body: dict) -> tuple[np.ndarray, int]:
        reply = http("POST", f"{embedder.url}/v1/embeddings", json=body)
        assert reply.status == 200, reply.body
        out = reply.json()
        return np.array(out["data"][0]["embedding"]), out["usage"]["prompt_tokens"]

    cut, tokens = embed({"input": LONG, "truncate_prompt_tokens": 8})
    assert tokens == 8
    last, _ = embed({"input": ids[-8:]})
    assert np.abs(cut - last).max() <= 1e-5
    whole, tokens = embed({"input": LONG, "truncate_prompt_tokens": -1})
    assert tokens == MAX_MODEL_LEN
    assert np.abs(whole - embed({"input": ids[-MAX_MODEL_LEN:]})[0]).max() <= 1e-5


def test_truncate_prompt_tokens_cuts_a_pair_with_the_tokenizer(reranker: Served):
    body = {"text_1": "w1 w2", "text_2": LONG, "truncate_prompt_tokens": 10}
    reply = http("POST", f"{reranker.url}/score", json=body)
    assert reply.status == 200, reply.body
    assert reply.json()["usage"]["prompt_tokens"] == 10
    expected = reranker.engine.tokenizer("w1 w2", LONG, truncation=True, max_length=10).input_ids
    assert expected[:2] == reranker.engine.tokenizer("w1 w2").input_ids  # the query stays
    same = http("POST", f"{reranker.url}/classify", json={"input": [expected]}).json()
    assert reply.json()["data"][0]["score"] == pytest.approx(same["data"][0]["probs"][0], abs=1e-5)


def test_the_inputs_of_one_call_run_concurrently(embedder: Served, monkeypatch: pytest.MonkeyPatch):
    """All of them are in the engine at once (it batches them), not one after another."""
    engine = embedder.engine
    real = engine.pool
    live, peak = [0], [0]

    async def counting(*args, **kwargs) -> RequestOutput:
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        try:
            return await real(*args, **kwargs)
        finally:
            live[0] -= 1

    monkeypatch.setattr(engine, "pool", counting)
    texts = [f"w{i} w{i + 1} w{i + 2}" for i in range(24)]
    reply = http("POST", f"{embedder.url}/v1/embeddings", json={"input": texts})
    assert reply.status == 200, reply.body
    assert peak[0] == len(texts)


def test_one_failed_input_cancels_the_others(embedder: Served, monkeypatch: pytest.MonkeyPatch):
    """An input that fails inside the engine fails the call (500, the OpenAI error object) at
    once: the others, still running, are cancelled (which aborts their engine requests)."""
    engine = embedder.engine
    cancelled: list[str] = []

    async def failing(prompt, params, request_id, **kwargs) -> RequestOutput:
        if request_id.endswith("-2"):
            await asyncio.sleep(0.05)
            return RequestOutput(
                request_id, [], "", None, len(prompt), 0, 0, True, "error", error="boom"
            )
        try:
            await asyncio.sleep(60)  # an input that would take long
        except asyncio.CancelledError:
            cancelled.append(request_id)
            raise
        raise AssertionError("not cancelled")

    monkeypatch.setattr(engine, "pool", failing)
    reply = http("POST", f"{embedder.url}/v1/embeddings", json={"input": ["w1"] * 5})
    error = assert_error(reply, 500, code="pooling_failed")
    assert "boom" in error["message"]
    prefix = cancelled[0].rsplit("-", 1)[0]
    assert sorted(cancelled) == [f"{prefix}-{i}" for i in (0, 1, 3, 4)]


def _finished(metrics: str, reason: str) -> float:
    """``paged_serve_request_success_total`` for ``reason`` in a /metrics body."""
    name = f'paged_serve_request_success_total{{finished_reason="{reason}"}} '
    line = next(line for line in metrics.splitlines() if line.startswith(name))
    return float(line.rsplit(" ", 1)[1])


async def _drop_once_running(url: str, body: dict) -> tuple[float, float]:
    """Post ``body`` to ``url``/v1/embeddings and close the connection once some of its
    requests have finished; the finished-request counts (stop, abort) before the post."""
    async with aiohttp.ClientSession() as session:

        async def finished(reason: str) -> float:
            async with session.get(f"{url}/metrics") as reply:
                return _finished(await reply.text(), reason)

        before = await finished("stop"), await finished("abort")
        call = asyncio.ensure_future(session.post(f"{url}/v1/embeddings", json=body))
        while await finished("stop") == before[0]:
            assert not call.done(), "the call ended before it could be dropped"
            await asyncio.sleep(0.005)
        call.cancel()
        return before


def test_a_client_that_goes_away_aborts_every_input(embedder: Served):
    url = embedder.url
    texts = [" ".join(f"w{(i + j) % 100}" for j in range(MAX_MODEL_LEN - 4)) for i in range(1500)]
    stopped, aborted = asyncio.run(_drop_once_running(url, {"input": texts}))
    check_pool(embedder.engine)
    metrics = http("GET", f"{url}/metrics").body.decode()
    ran = _finished(metrics, "stop") - stopped
    assert 0 < ran < len(texts) / 2  # it did not run to the end
    assert _finished(metrics, "abort") - aborted > 0
    assert http("POST", f"{url}/v1/embeddings", json={"input": "w1"}).status == 200
