"""Greedy tokens equal Hugging Face ``generate`` (fp32) token for token, for every supported
family, whether requests run alone, batched with staggered arrivals, chunked or preempted."""

from __future__ import annotations

import copy

import pytest
import torch

from paged_serve.engine import LLM, SamplingParams
from paged_serve.engine.config import EngineConfig
from paged_serve.engine.llm_engine import LLMEngine
from tests.conftest import assert_pool_clean, hf_greedy, loaded, random_prompts

LENGTHS = [1, 5, 15, 16, 17, 31, 40, 63, 100]
MAX_TOKENS = 20
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(tiny_family):
    family, model = tiny_family
    prompts = random_prompts(LENGTHS, seed=1)
    return family, model, prompts, [hf_greedy(model, p, MAX_TOKENS) for p in prompts]


def test_alone(expected):
    _, model, prompts, want = expected
    llm = LLM(loaded=loaded(model), kv_cache_memory=4 << 20)
    for prompt, tokens in zip(prompts, want):
        [result] = llm.generate([prompt], GREEDY)
        assert result.token_ids == tokens
        assert result.finish_reason == "length"
    assert_pool_clean(llm.engine.block_manager)


def test_batched_with_staggered_arrivals(expected):
    _, model, prompts, want = expected
    engine = LLMEngine(EngineConfig(kv_cache_memory=4 << 20), loaded=loaded(model))
    got: dict[str, list[int]] = {}
    ids: list[str] = []
    arrivals = {0: [0, 1, 2], 2: [3, 4], 3: [5], 7: [6, 7, 8]}  # step -> prompt indices
    step = 0
    while step <= max(arrivals) or engine.has_unfinished:
        for i in arrivals.get(step, []):
            ids.append(engine.add_request(prompts[i], GREEDY, request_id=f"r{i}"))
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
    assert len(ids) == len(prompts) >= 8
    assert [got[f"r{i}"] for i in range(len(prompts))] == want
    assert_pool_clean(engine.block_manager)


def test_chunked_prefill(expected):
    """A budget of 8 tokens a step splits every long prompt into chunks mixed with decodes."""
    _, model, prompts, want = expected
    llm = LLM(loaded=loaded(model), kv_cache_memory=4 << 20, max_num_batched_tokens=8)
    assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == want
    assert_pool_clean(llm.engine.block_manager)


def test_preemption(expected):
    """A pool of 12 blocks cannot hold all requests at once: they are preempted and recomputed."""
    _, model, prompts, want = expected
    hf = model.config
    block_bytes = hf.num_hidden_layers * 2 * 16 * hf.num_key_value_heads * hf.head_dim * 4
    llm = LLM(loaded=loaded(model), kv_cache_memory=12 * block_bytes, max_num_batched_tokens=64)
    assert llm.engine.block_manager.num_blocks == 12
    results = llm.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == want
    assert sum(r.metrics.num_preemptions for r in results) > 0
    assert llm.engine.scheduler.num_preemptions > 0
    assert_pool_clean(llm.engine.block_manager)


def test_prefix_cache_off_gives_same_tokens(expected):
    _, model, prompts, want = expected
    llm = LLM(loaded=loaded(model), kv_cache_memory=4 << 20, enable_prefix_caching=False)
    assert [r.token_ids for r in llm.generate(prompts, GREEDY)] == want
    assert_pool_clean(llm.engine.block_manager)


def test_bf16_alone_equals_hf_bf16(tiny_family):
    """In bf16 a request alone computes what HF computes for it (the CPU backend attends in the
    model's dtype with HF's layout; packed projections are exact), so the tokens are equal too.
    Batching changes bf16 rounding (docs/measurements/engine-vs-hf.md measures by how much)."""
    _, model = tiny_family
    model = copy.deepcopy(model).to(torch.bfloat16)
    llm = LLM(loaded=loaded(model), kv_cache_memory=4 << 20)
    for prompt in random_prompts(LENGTHS, seed=2):
        [result] = llm.generate([prompt], GREEDY)
        assert result.token_ids == hf_greedy(model, prompt, MAX_TOKENS)
    assert_pool_clean(llm.engine.block_manager)
