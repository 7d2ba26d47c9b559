"""Prefix caching and copy-on-write sharing for n > 1, end to end through the engine."""

from __future__ import annotations

import pytest

from paged_serve.engine import LLM, EngineConfig, SamplingParams
from paged_serve.engine.llm_engine import LLMEngine
from paged_serve.engine.sched.block_manager import BlockManager
from paged_serve.engine.sched.forks import sample_ids
from tests.conftest import assert_pool_clean, hf_greedy, loaded, random_prompts, tiny_model

BS = 16


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=3)


def engine_for(model, **kw) -> LLMEngine:
    return LLMEngine(
        EngineConfig(kv_cache_memory=kw.pop("kv", 4 << 20), **kw), loaded=loaded(model)
    )


def run(engine: LLMEngine, prompt, params) -> list:
    """Run one request to completion; return its per-sample outputs' token lists and last outs."""
    rid = engine.add_request(prompt, params)
    tokens = {s: [] for s in sample_ids(rid, params.n)}
    finals = {}
    while engine.has_unfinished:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finals[out.request_id] = out
    return [tokens[s] for s in sample_ids(rid, params.n)], [finals[s] for s in tokens]


SYSTEM = random_prompts([50], seed=11)[0]
QUESTIONS = random_prompts([7, 12, 3], seed=12)
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=9, ignore_eos=True)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_outputs_identical_with_cache_on_and_off(model, params):
    prompts = [SYSTEM + q for q in QUESTIONS]
    on = engine_for(model)
    off = engine_for(model, enable_prefix_caching=False)
    got_on = [run(on, p, params)[0] for p in prompts]
    got_off = [run(off, p, params)[0] for p in prompts]
    assert got_on == got_off
    if params is GREEDY:
        assert [g[0] for g in got_on] == [hf_greedy(model, p, 8) for p in prompts]
    # Later requests hit the 3 full blocks of the shared 50-token system prompt.
    assert on.scheduler.prefix_hit_tokens == 2 * 3 * BS
    assert off.scheduler.prefix_hit_tokens == 0
    assert_pool_clean(on.block_manager)
    assert_pool_clean(off.block_manager)


def test_cached_tokens_are_reported_per_request(model):
    engine = engine_for(model)
    _, [first] = run(engine, SYSTEM + QUESTIONS[0], GREEDY)
    _, [second] = run(engine, SYSTEM + QUESTIONS[1], GREEDY)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 3 * BS
    assert second.metrics.num_cached_tokens == 3 * BS
    assert engine.scheduler.prefix_query_tokens == len(SYSTEM) * 2 + 7 + 12


def test_prompt_an_exact_multiple_of_block_size(model):
    prompt = random_prompts([2 * BS], seed=4)[0]
    engine = engine_for(model)
    first, _ = run(engine, prompt, GREEDY)
    again, [out] = run(engine, prompt, GREEDY)
    assert first == again == [hf_greedy(model, prompt, 8)]
    # The block holding the last prompt token is recomputed (its logits are needed).
    assert out.num_cached_tokens == BS
    assert_pool_clean(engine.block_manager)


def test_fully_cached_prompt_still_produces_its_first_token(model):
    """A prompt whose blocks are all cached, one token past a block edge."""
    prompt = random_prompts([2 * BS + 1], seed=5)[0]
    engine = engine_for(model)
    run(engine, prompt, GREEDY)
    again, [out] = run(engine, prompt, GREEDY)
    assert out.num_cached_tokens == 2 * BS
    assert again == [hf_greedy(model, prompt, 8)]
    assert_pool_clean(engine.block_manager)


def test_conversation_continuation_reuses_the_previous_turn(model):
    engine = engine_for(model)
    turn1 = SYSTEM + QUESTIONS[0]
    [answer], _ = run(engine, turn1, GREEDY)
    turn2 = turn1 + answer + QUESTIONS[1]
    [reply], [out] = run(engine, turn2, GREEDY)
    assert out.num_cached_tokens == (len(turn1) + len(answer) - 1) // BS * BS
    assert reply == hf_greedy(model, turn2, 8)


def test_hit_after_preemption_and_eviction_under_pressure(model):
    hf = model.config
    block_bytes = hf.num_hidden_layers * 2 * BS * hf.num_key_value_heads * hf.head_dim * 4
    llm = LLM(loaded=loaded(model), kv_cache_memory=10 * block_bytes, max_num_batched_tokens=64)
    prompts = [SYSTEM + q for q in QUESTIONS] + random_prompts([60, 45], seed=13)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    results = llm.generate(prompts, params)
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.prefix_hit_tokens > 0
    assert [r.token_ids for r in results] == [hf_greedy(model, p, 20) for p in prompts]
    assert_pool_clean(engine.block_manager)
    # Fill the pool with unrelated prompts: the cached system prompt is evicted, LRU first.
    llm.generate(random_prompts([70, 70], seed=14), SamplingParams(max_tokens=5, temperature=0))
    assert engine.block_manager.cached_prefix(prompts[0]) == []
    assert_pool_clean(engine.block_manager)


def test_n3_seeded_equals_three_single_requests_and_shares_blocks(model):
    prompt = random_prompts([40], seed=21)[0]  # 2 full blocks and a partial one
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=77, n=3, ignore_eos=True)
    engine = engine_for(model, enable_prefix_caching=False)
    rid = engine.add_request(prompt, params)
    engine.step()  # prefill once, then fork: all three hold the same 3 blocks
    assert engine.block_manager.usage().used_blocks == 3
    tables = [engine.block_manager.block_table(s) for s in sample_ids(rid, 3)]
    assert tables[0] == tables[1] == tables[2]
    engine.step()  # each sample writes its token: the partial block is copied on write
    tables = [engine.block_manager.block_table(s) for s in sample_ids(rid, 3)]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert len({t[2] for t in tables}) == 3
    assert engine.block_manager.usage().used_blocks == 5
    engine.block_manager.check_integrity()
    while engine.has_unfinished:
        engine.step()
    assert_pool_clean(engine.block_manager)

    together = LLM(loaded=loaded(model), kv_cache_memory=4 << 20).generate([prompt], params)
    single = LLM(loaded=loaded(model), kv_cache_memory=4 << 20)
    alone = [
        single.generate(
            [prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=77 + i, ignore_eos=True)
        )[0].token_ids
        for i in range(3)
    ]
    assert [r.token_ids for r in together] == alone
    assert len({tuple(a) for a in alone}) > 1


def test_aborting_the_first_sample_before_prefill_keeps_the_others(model):
    engine = engine_for(model)
    params = SamplingParams(max_tokens=4, temperature=0, n=3, ignore_eos=True)
    rid = engine.add_request(random_prompts([20], seed=8)[0], params)
    engine.abort(rid)
    finished = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.num_output_tokens
    assert finished == {f"{rid}.1": 4, f"{rid}.2": 4}
    assert_pool_clean(engine.block_manager)


def test_a_hit_needs_the_whole_prefix_even_when_cache_keys_collide(monkeypatch):
    """With a cache key that ignores the parent (the worst collision), a block cached after one
    prefix is never a hit after another prefix that ends in the same tokens."""
    import builtins

    import paged_serve.engine.sched.prefix_cache as bm_module
    monkeypatch.setattr(bm_module, "prefix_key", lambda parent, toks: repr(toks).encode(), False)
    monkeypatch.setattr(bm_module, "hash", lambda t: builtins.hash(t[1]), False)  # ignores parent
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    x, y, z, v = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]
    for rid, tokens in (("a", x + y + [0]), ("c", z + v + [0])):
        bm.allocate(rid, len(tokens))
        bm.commit(rid, tokens, len(tokens))
    assert bm.cached_prefix(x + y + [0]) == bm.block_table("a")[:2]
    # x hits a's first block; v's block follows z, not x, so it is no hit.
    assert bm.cached_prefix(x + v + [0]) == bm.block_table("a")[:1]
    bm.free("a")
    bm.free("c")
    bm.check_integrity()


def test_prefix_keys_differ_between_processes():
    """The digest is keyed per process: nobody can precompute colliding prefixes."""
    import subprocess
    import sys

    code = (
        "from engine.sched.prefix_cache import prefix_key; "
        "print(prefix_key(b'', (1, 2, 3)).hex())"
    )
    keys = {subprocess.check_output([sys.executable, "-c", code], text=True) for _ in range(2)}
    assert len(keys) == 2
