"""Prompt logprobs through the server stay exact when the prompt is prefilled in chunks, the
request is preempted and recomputed, and an ordinary request runs beside it (vLLM crashed
exactly there).

The small pool (12 blocks of 16 tokens, prefill chunks of at most 32 tokens, no prefix cache)
cannot hold both requests to their end: A (95 prompt tokens + 12) needs 7 blocks, B (79 + 12)
6, so the one admitted last is preempted and recomputed once the other has finished.
"""

from __future__ import annotations

import asyncio

from transformers import PreTrainedModel

from tests.conftest import hf_greedy, hf_prompt_logprobs
from tests.reliability.conftest import LocalServer, arequest, assert_pool_clean

A_IDS = [1000 + 7 * i for i in range(95)]
B_IDS = [20_000 + 11 * i for i in range(79)]
MAX_TOKENS = 12
TOP = 2
ATOL = 1e-4


def _body(ids: list[int], **fields: object) -> dict:
    return {"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **fields}


async def _both(url: str) -> tuple[dict, dict]:
    a, b = await asyncio.gather(
        arequest("POST", url, json=_body(A_IDS)),
        arequest("POST", url, json=_body(B_IDS, echo=True, logprobs=TOP, prompt_logprobs=TOP)),
    )
    assert a.status == 200 and b.status == 200, (a.body[:300], b.body[:300])
    return a.json(), b.json()


def test_scored_prompt_chunked_preempted_beside_an_ordinary_request(
    small_pool: LocalServer, hf_default_model: PreTrainedModel
):
    engine = small_pool.engine
    tokenizer = engine.tokenizer
    before = engine.snapshot().num_preemptions
    a, b = asyncio.run(_both(f"{small_pool.url}/v1/completions"))
    assert engine.snapshot().num_preemptions > before

    # The ordinary request's tokens are HF's greedy ones.
    [a_choice] = a["choices"]
    assert a_choice["text"] == tokenizer.decode(hf_greedy(hf_default_model, A_IDS, MAX_TOKENS))

    # The scored one: its prompt logprobs equal HF's, once each, in both shapes.
    [b_choice] = b["choices"]
    want, want_top = hf_prompt_logprobs(hf_default_model, B_IDS, TOP)
    echo = b_choice["logprobs"]
    assert len(echo["tokens"]) == len(B_IDS) + MAX_TOKENS
    assert echo["token_logprobs"][0] is None
    got = echo["token_logprobs"][1 : len(B_IDS)]
    assert max(abs(g - w) for g, w in zip(got, want)) < ATOL
    entries = b_choice["prompt_logprobs"]
    assert len(entries) == len(B_IDS) and entries[0] is None
    for j, entry in enumerate(entries[1:], 1):
        assert abs(entry[str(B_IDS[j])]["logprob"] - want[j - 1]) < ATOL
        assert {int(t) for t, v in entry.items() if v["rank"] is not None} >= set(want_top[j - 1])
    generated = tokenizer.decode(hf_greedy(hf_default_model, B_IDS, MAX_TOKENS))
    assert b_choice["text"] == tokenizer.decode(B_IDS) + generated
    assert_pool_clean(engine)
