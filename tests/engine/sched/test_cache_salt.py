"""Cache salts partition the prefix cache: a request is served only blocks computed under its own
salt (``BlockManager.cached_prefix``), and every block it commits - after a fork, a preemption
or a verified speculative step - extends the same salted chain."""

from __future__ import annotations

import pytest

from paged_serve.engine import EngineConfig, SamplingParams
from paged_serve.engine.llm_engine import LLMEngine
from paged_serve.engine.sched.block_manager import BlockManager
from paged_serve.engine.sched.prefix_cache import chain_root
from tests.conftest import assert_pool_clean, loaded, random_prompts, tiny_model
from tests.engine.spec.test_speculative import ScriptedDrafter, spec_config

BS = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPT = random_prompts([70], seed=31)[0]  # 4 full blocks and a partial one


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=3)


def engine_for(model, **config) -> LLMEngine:
    config.setdefault("kv_cache_memory", 4 << 20)
    return LLMEngine(EngineConfig(**config), loaded=loaded(model))


def run(engine: LLMEngine, prompt, params, cache_salt: str | None) -> tuple[list[int], int]:
    """One request to its end: the first sample's tokens and its cached prompt tokens."""
    rid = engine.add_request(prompt, params, cache_salt=cache_salt)
    tokens: list[int] = []
    cached = -1
    while engine.has_unfinished:
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                cached = out.num_cached_tokens
    return tokens, cached


def test_the_block_manager_serves_a_chain_only_to_its_own_salt():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    tokens = list(range(1, 14))  # 3 full blocks and one token
    bm.allocate("a", len(tokens), cache_salt="alice")
    bm.commit("a", tokens, len(tokens))
    held = bm.block_table("a")[:3]
    assert bm.cached_prefix(tokens, "alice") == held
    assert bm.cached_prefix(tokens, "bob") == []
    assert bm.cached_prefix(tokens) == []  # the unsalted chain is a salt of its own
    # A fork extends the parent's chain: its new blocks hit under "alice" only.
    bm.fork("a", "a.1")
    longer = tokens + [20, 21, 22, 23]
    bm.append_slots("a.1", len(longer))
    bm.commit("a.1", longer, len(longer))
    assert bm.cached_prefix(longer + [0], "alice") == bm.block_table("a.1")[:4]
    assert bm.cached_prefix(longer + [0]) == []
    bm.free("a")
    bm.free("a.1")
    bm.check_integrity()
    # Freed, the blocks stay cached in their chain; an unsalted twin computes its own.
    assert bm.cached_prefix(tokens, "alice") == held
    bm.allocate("u", len(tokens))
    bm.commit("u", tokens, len(tokens))
    assert set(bm.block_table("u")).isdisjoint(held)
    assert bm.cached_prefix(tokens) == bm.block_table("u")[:3]
    bm.free("u")
    bm.check_integrity()
    assert bm.usage().used_blocks == 0


def test_chain_roots_differ_by_salt_and_the_unsalted_root_is_empty():
    assert chain_root(None) == b""
    assert len({chain_root("a"), chain_root("b"), chain_root("")}) == 3


def test_salted_requests_hit_only_under_their_own_salt(model):
    engine = engine_for(model)
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=5, n=3, ignore_eos=True)
    first, cached = run(engine, PROMPT, params, "alice")  # forked three ways
    assert cached == 0
    assert run(engine, PROMPT, GREEDY, "bob")[1] == 0
    assert run(engine, PROMPT, GREEDY, None)[1] == 0
    again, cached = run(engine, PROMPT, params, "alice")
    assert cached == 4 * BS
    assert again == first  # the cache changes the speed, never the tokens
    assert run(engine, PROMPT, GREEDY, "bob")[1] == 4 * BS
    assert run(engine, PROMPT, GREEDY, None)[1] == 4 * BS
    assert_pool_clean(engine.block_manager)


def test_a_fork_heir_readmitted_after_an_abort_keeps_the_salt(model):
    engine = engine_for(model)
    params = SamplingParams(max_tokens=4, temperature=0, n=3, ignore_eos=True)
    rid = engine.add_request(PROMPT, params, cache_salt="alice")
    engine.abort(rid)  # its forks go on under an heir, re-queued
    while engine.has_unfinished:
        engine.step()
    assert_pool_clean(engine.block_manager)
    bm = engine.block_manager
    assert len(bm.cached_prefix(PROMPT, "alice")) == 4
    assert bm.cached_prefix(PROMPT) == []


def test_recomputed_blocks_after_preemption_stay_in_the_salted_chain(model):
    hf = model.config
    block_bytes = hf.num_hidden_layers * 2 * BS * hf.num_key_value_heads * hf.head_dim * 4
    engine = engine_for(model, kv_cache_memory=10 * block_bytes, max_num_batched_tokens=64)
    prompts = random_prompts([50, 45, 60, 40], seed=13)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=f"r{i}", cache_salt="alice")
    while engine.has_unfinished:
        engine.step()
    assert engine.scheduler.num_preemptions > 0
    assert_pool_clean(engine.block_manager)
    bm = engine.block_manager
    assert any(bm.cached_prefix(p, "alice") for p in prompts)
    assert not any(bm.cached_prefix(p) or bm.cached_prefix(p, "bob") for p in prompts)


def test_verified_speculative_tokens_are_committed_in_the_salted_chain(model):
    prompt = random_prompts([20], seed=4)[0]
    params = SamplingParams(max_tokens=41, temperature=0, ignore_eos=True)
    expected, _ = run(engine_for(model), prompt, params, None)
    engine = engine_for(model, speculative_config=spec_config(), max_num_seqs=8)
    vocab = int(model.config.vocab_size)
    engine.speculator.drafter = ScriptedDrafter({"r": expected}, vocab, wrong="one")
    engine.add_request(prompt, params, request_id="r", cache_salt="alice")
    while engine.has_unfinished:
        engine.step()
    assert engine.speculator.stats.num_accepted_tokens > 0
    assert_pool_clean(engine.block_manager)
    bm = engine.block_manager
    sequence = prompt + expected  # 61 tokens: 3 full blocks, two of them generated ones
    assert len(bm.cached_prefix(sequence, "alice")) == 3
    assert bm.cached_prefix(sequence) == []


def test_an_empty_or_non_string_salt_is_refused(model):
    engine = engine_for(model)
    for salt in ("", 7):
        with pytest.raises(ValueError, match="cache_salt"):
            engine.add_request(PROMPT, GREEDY, cache_salt=salt)
    assert not engine.has_unfinished
