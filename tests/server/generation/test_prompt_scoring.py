"""Prompt scoring through the server, on the default model: ``echo`` with ``logprobs``,
``max_tokens`` 0, vLLM's ``prompt_logprobs`` on completions and chat, and what
lm-evaluation-harness computes from the replies. Values are compared with Hugging Face's
``log_softmax`` over one full fp32 forward (to 1e-4), with the prefix cache cold and warm."""

from __future__ import annotations

import json

import pytest
from transformers import PreTrainedModel

from paged_serve.engine.async_engine import AsyncEngine
from tests.conftest import hf_prompt_logprobs
from tests.server.conftest import http, parse_sse

ATOL = 1e-4
CONTEXT = "Question: Which city is the capital of France?\nAnswer:"
CONTINUATIONS = [" Paris", " Berlin", " a large city on the Seine"]


def post(base_url: str, path: str, body: dict) -> dict:
    reply = http("POST", f"{base_url}/v1/{path}", json=body)
    assert reply.status == 200, reply.body
    return reply.json()


def score(base_url: str, prompt: object, **fields) -> dict:
    """lm-evaluation-harness's local-completions loglikelihood request."""
    body = {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    return post(base_url, "completions", {**body, **fields})


def token_texts(engine: AsyncEngine, ids: list[int]) -> list[str]:
    return [engine.tokenizer.decode([t]) for t in ids]


def check_echo(
    engine: AsyncEngine, model: PreTrainedModel, ids: list[int], logprobs: dict, top: int
) -> None:
    """The first len(ids) entries of an echo's logprobs are the prompt's, equal to HF's."""
    want, want_top = hf_prompt_logprobs(model, ids, top)
    n = len(ids)
    assert logprobs["tokens"][:n] == token_texts(engine, ids)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    got = logprobs["token_logprobs"][1:n]
    assert max(abs(g - w) for g, w in zip(got, want)) < ATOL
    texts = logprobs["tokens"]
    for j in range(1, n):
        top_j = logprobs["top_logprobs"][j]
        assert top_j[texts[j]] == logprobs["token_logprobs"][j]  # the prompt token is in it
        assert set(token_texts(engine, want_top[j - 1])) <= set(top_j)
        assert len(top_j) <= top + 1
    assert logprobs["text_offset"] == [sum(map(len, texts[:i])) for i in range(len(texts))]


@pytest.mark.parametrize("cache", ["cold", "warm"])
def test_echo_logprobs_equal_hf(
    base_url: str, engine: AsyncEngine, hf_default_model: PreTrainedModel, cache: str
):
    text = f"{CONTEXT} Paris, on the Seine ({cache} cache)."
    ids = engine.tokenize(text)
    assert len(ids) > 16  # at least one full block the prefix cache could serve
    if cache == "warm":  # the prompt's blocks are in the prefix cache now
        post(base_url, "completions", {"prompt": ids, "max_tokens": 1})
    out = score(base_url, text, logprobs=3)
    [choice] = out["choices"]
    assert choice["text"].startswith(text)
    assert len(choice["logprobs"]["tokens"]) == len(ids) + 1  # the prompt, then one token
    check_echo(engine, hf_default_model, ids, choice["logprobs"], top=3)
    # the generated token's offset continues the prompt's
    assert choice["logprobs"]["text_offset"][-1] == sum(map(len, token_texts(engine, ids)))
    assert out["usage"]["prompt_tokens"] == len(ids)
    # scoring computes every prompt position: a warm cache served none of them
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_the_sum_is_what_lm_eval_computes(
    base_url: str, engine: AsyncEngine, hf_default_model: PreTrainedModel
):
    """lm-eval's local-completions model sums token_logprobs[ctxlen:-1] of this reply: it
    equals the continuation's log-likelihood under HF, and its greedy flag HF's argmax."""
    lm_eval = pytest.importorskip("lm_eval.models.openai_completions")
    context = engine.tokenizer(CONTEXT, add_special_tokens=False).input_ids
    for continuation in CONTINUATIONS:
        cont = engine.tokenizer(continuation, add_special_tokens=False).input_ids
        ids = context + cont
        out = score(base_url, [ids])  # lm-eval sends token ids, a batch of one
        [(total, greedy)] = lm_eval.LocalCompletionsAPI.parse_logprobs(
            outputs=out, tokens=[ids], ctxlens=[len(context)]
        )
        want, want_top = hf_prompt_logprobs(hf_default_model, ids, top=1)
        assert total == pytest.approx(sum(want[len(context) - 1 :]), abs=ATOL * len(cont))
        hf_greedy = all(want_top[j - 1][0] == ids[j] for j in range(len(context), len(ids)))
        assert greedy == hf_greedy
    assert greedy is False  # the long continuation is not the model's greedy one


def test_max_tokens_zero_scores_only(base_url: str, engine: AsyncEngine):
    ids = engine.tokenize(CONTEXT)
    out = score(base_url, CONTEXT, max_tokens=0, logprobs=0)
    [choice] = out["choices"]
    assert choice["text"] == CONTEXT
    assert choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    assert all(len(top) == 1 for top in choice["logprobs"]["top_logprobs"][1:])
    assert out["usage"]["completion_tokens"] == 0
    # echo without logprobs and nothing to generate: the prompt back, no logprobs
    bare = post(base_url, "completions", {"prompt": CONTEXT, "echo": True, "max_tokens": 0})
    assert bare["choices"][0]["text"] == CONTEXT
    assert bare["choices"][0]["logprobs"] is None


def test_echo_streams_with_its_logprobs(base_url: str, engine: AsyncEngine):
    whole = score(base_url, [CONTEXT, "Hello there"], n=2, max_tokens=3, logprobs=2)
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
    # both samples of a prompt echo it with the same logprobs (their greedy tokens agree, and
    # those logprobs may differ in the last bits: the samples decode in different rows)
    first, second = (c["logprobs"] for c in whole["choices"][:2])
    n = len(engine.tokenize(CONTEXT))
    assert first["tokens"] == second["tokens"]
    assert first["top_logprobs"][:n] == second["top_logprobs"][:n]
    reply = http(
        "POST",
        f"{base_url}/v1/completions",
        json={
            "prompt": [CONTEXT, "Hello there"],
            "n": 2,
            "echo": True,
            "logprobs": 2,
            "max_tokens": 3,
            "temperature": 0,
            "stream": True,
        },
    )
    assert reply.status == 200
    frames = parse_sse(reply.body)
    assert frames[-1] == (None, "[DONE]")
    text = {i: "" for i in range(4)}
    merged: dict[int, dict] = {}
    for _, data in frames[:-1]:
        [choice] = json.loads(data)["choices"]
        i = choice["index"]
        text[i] += choice["text"]
        if choice["logprobs"]:
            for key, values in choice["logprobs"].items():
                merged.setdefault(i, {}).setdefault(key, []).extend(values)
    for choice in whole["choices"]:
        assert text[choice["index"]] == choice["text"]
        assert merged[choice["index"]] == choice["logprobs"]


def test_prompt_logprobs_on_completions(
    base_url: str, engine: AsyncEngine, hf_default_model: PreTrainedModel
):
    ids = engine.tokenize(CONTEXT)
    out = post(
        base_url,
        "completions",
        {"prompt": CONTEXT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2},
    )
    [choice] = out["choices"]
    assert choice["text"] and choice["logprobs"] is None  # no echo: the text is generated only
    check_prompt_logprobs(engine, hf_default_model, ids, choice["prompt_logprobs"], top=2)
    assert (
        "prompt_logprobs"
        not in post(base_url, "completions", {"prompt": CONTEXT, "max_tokens": 1})["choices"][0]
    )


def check_prompt_logprobs(
    engine: AsyncEngine, model: PreTrainedModel, ids: list[int], entries: list, top: int
) -> None:
    """vLLM's shape: None, then {id: {logprob, rank, decoded_token}} with the prompt token and
    the top alternatives; values equal HF's."""
    want, want_top = hf_prompt_logprobs(model, ids, top)
    assert len(entries) == len(ids) and entries[0] is None
    for j in range(1, len(ids)):
        entry = entries[j]
        token = entry[str(ids[j])]
        assert abs(token["logprob"] - want[j - 1]) < ATOL
        assert token["decoded_token"] == engine.tokenizer.decode([ids[j]])
        alternatives = {int(k): v for k, v in entry.items() if v["rank"] is not None}
        assert set(want_top[j - 1]) <= set(alternatives)
        ranked = sorted(alternatives.values(), key=lambda v: v["rank"])
        assert [v["rank"] for v in ranked][:top] == list(range(1, top + 1))
        assert all(a["logprob"] >= b["logprob"] for a, b in zip(ranked, ranked[1:]))
        if token["rank"] is None:
            assert token["logprob"] <= ranked[top - 1]["logprob"]


def test_prompt_logprobs_on_chat(
    base_url: str, engine: AsyncEngine, hf_default_model: PreTrainedModel
):
    messages = [{"role": "user", "content": "Name the capital of France."}]
    tokenized = http("POST", f"{base_url}/tokenize", json={"messages": messages}).json()
    out = post(
        base_url,
        "chat/completions",
        {"messages": messages, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1, "n": 2},
    )
    assert out["usage"]["prompt_tokens"] == tokenized["count"]
    check_prompt_logprobs(engine, hf_default_model, tokenized["tokens"], out["prompt_logprobs"], 1)
    plain = post(base_url, "chat/completions", {"messages": messages, "max_tokens": 1})
    assert "prompt_logprobs" not in plain
