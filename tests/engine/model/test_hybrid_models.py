"""Hybrid linear-attention models (Qwen3-Next, Qwen3.5) in the engine: what their state slots
must get right beyond tests/engine/model/test_model_coverage.py's scenarios, which they pass too
(greedy == HF alone, batched through chunked prefill, after preemption; logprobs; seeded n = 2).

* A fork starts from its parent's state: sample ``i`` of a seeded ``n = 2`` request equals a
  single request with seed ``seed + i`` (which never forks).
* The triton backend (kernels under the interpreter) and the decode-graph path give HF's tokens.
* Only the attention layers have KV blocks; aborting mid-prefill, preemption and finishing
  return every slot. Prefix hits resume from state snapshots:
  test_hybrid_prefix_caching.py.
"""

from __future__ import annotations

import pytest
import torch

from paged_serve.engine import LLM, SamplingParams
from paged_serve.engine.runner.decode_graphs import DecodeGraphs, EagerReplay
from paged_serve.engine.sched.state_slots import StateSlots
from tests.conftest import assert_pool_clean, hf_greedy, loaded, random_prompts
from tests.engine.model.test_model_coverage import tiny_architecture

PROMPTS = random_prompts([1, 17, 33, 40], seed=31)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
HYBRIDS = ["qwen3_next", "qwen3_5"]


@pytest.fixture(scope="module", params=HYBRIDS)
def hybrid(request: pytest.FixtureRequest):
    model = tiny_architecture(request.param)
    return model, [hf_greedy(model, p, 6) for p in PROMPTS]


def test_forks_start_from_their_parents_state(hybrid) -> None:
    model, _ = hybrid
    llm = LLM(loaded=loaded(model), kv_cache_memory=4 << 20, max_num_seqs=8)
    sampled = dict(max_tokens=8, temperature=1.0, ignore_eos=True)
    forked = llm.generate([PROMPTS[2]], SamplingParams(n=2, seed=7, **sampled))
    alone = [llm.generate([PROMPTS[2]], SamplingParams(seed=s, **sampled))[0] for s in (7, 8)]
    assert [r.token_ids for r in forked] == [r.token_ids for r in alone]
    assert forked[0].token_ids != forked[1].token_ids
    assert_pool_clean(llm.engine.block_manager)


def test_kv_blocks_only_for_attention_layers_and_snapshot_rows(hybrid) -> None:
    """Only the attention layer has KV; the state cache holds 8 slots, a scratch row and 8
    snapshot rows; without a snapshot interval prefix caching is off, so nothing hits."""
    model, want = hybrid
    llm = LLM(loaded=loaded(model), kv_cache_memory=4 << 20, max_num_seqs=8)
    runner = llm.engine.runner
    assert runner.kv_cache.tensor.shape[0] == 1  # layer 1 of 3
    conv, recurrent = runner.state_cache.layer(2)
    assert conv.shape == (17, 3, 2 * 2 * 16 + 4 * 24) and recurrent.shape == (17, 4, 16, 24)
    assert recurrent.dtype == torch.float32
    plain = LLM(loaded=loaded(model), kv_cache_memory=4 << 20, state_snapshot_interval=0)
    assert not plain.engine.block_manager.enable_prefix_caching
    assert plain.engine.runner.state_cache.num_snapshots == 0
    plain.generate([PROMPTS[3]], GREEDY)
    [again] = plain.generate([PROMPTS[3]], GREEDY)
    assert again.token_ids == want[3] and again.metrics.num_cached_tokens == 0
    assert_pool_clean(plain.engine.block_manager)


def test_abort_mid_prefill_returns_the_slot(hybrid) -> None:
    model, want = hybrid
    engine = LLM(loaded=loaded(model), kv_cache_memory=4 << 20, max_num_batched_tokens=8).engine
    rid = engine.add_request(PROMPTS[3], SamplingParams(max_tokens=6, n=2, ignore_eos=True))
    other = engine.add_request(PROMPTS[1], GREEDY)
    engine.step()  # 8 of 40 prompt tokens: mid-prefill
    assert engine.block_manager.state_slots.num_free < engine.block_manager.state_slots.num_slots
    engine.abort(rid)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert tokens[other] == want[1]
    assert_pool_clean(engine.block_manager)


def test_the_kernels_in_the_engine_and_the_graph_path(hybrid) -> None:
    """Triton backend, prefill chunks of 24 tokens, then decode steps replayed through the
    graphs' static buffers (padding rows on the scratch slot): HF's greedy tokens."""
    model, want = hybrid
    llm = LLM(
        loaded=loaded(model),
        kv_cache_memory=2 << 20,
        attention_backend="triton",
        max_num_batched_tokens=24,
        max_num_seqs=8,
    )
    engine = llm.engine
    graphs = DecodeGraphs(
        engine.runner.model,
        engine.runner.kv_cache,
        engine.runner.backend,
        max_batch_size=8,
        max_model_len=engine.max_model_len,
        state_cache=engine.runner.state_cache,
    )
    engine.runner.enable_decode_graphs(graphs, EagerReplay())
    tokens = 4  # 3 decode steps of every row (each step interprets all the kernels)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    results = llm.generate(PROMPTS[:3], params)
    assert [r.token_ids for r in results] == [w[:tokens] for w in want[:3]]
    assert graphs.replays[4] > 0  # three rows and a padding row
    assert_pool_clean(engine.block_manager)


def test_tensor_parallel_forks_and_chunks_equal_one_rank(hybrid) -> None:
    """TP=2 (gloo): each rank holds half the key and value heads and their states; the driver
    sends the fork copies with the step. Seeded n = 2 samples through 8-token chunks equal
    TP=1's."""
    model, _ = hybrid
    params = SamplingParams(max_tokens=6, temperature=1.0, n=2, seed=3, ignore_eos=True)
    kwargs = dict(kv_cache_memory=4 << 20, max_num_batched_tokens=8, max_num_seqs=8)
    want = [r.token_ids for r in LLM(loaded=loaded(model), **kwargs).generate(PROMPTS, params)]
    tp2 = LLM(loaded=loaded(model), tensor_parallel_size=2, **kwargs)
    try:
        assert [r.token_ids for r in tp2.generate(PROMPTS, params)] == want
        assert_pool_clean(tp2.engine.block_manager)
    finally:
        tp2.shutdown()


def test_a_qwen3_5_vision_language_checkpoint_serves_its_text_model(tmp_path) -> None:
    """A ``Qwen3_5ForConditionalGeneration`` (vision-language) folder: transformers loads its
    text model for a causal LM, which the engine serves with the tokens the whole model's
    ``generate`` gives for text."""
    import transformers

    from tests.engine.model.test_model_coverage import COMMON, HYBRID

    config = transformers.Qwen3_5Config(
        text_config={**COMMON, **HYBRID},
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                           out_hidden_size=COMMON["hidden_size"]),
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.Qwen3_5ForConditionalGeneration(config).eval().save_pretrained(tmp_path)
    whole = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(tmp_path).eval()
    whole.config.text_config._attn_implementation = "eager"
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory=4 << 20, max_num_seqs=8)
    assert type(llm.engine.runner.model).__name__ == "Qwen3_5ForCausalLM"
    got = [r.token_ids for r in llm.generate(PROMPTS[:3], GREEDY)]
    assert got == [hf_greedy(whole, p, 6) for p in PROMPTS[:3]]
    assert_pool_clean(llm.engine.block_manager)


def test_a_budget_the_states_fill_is_refused_naming_them() -> None:
    model = tiny_architecture("qwen3_5")
    with pytest.raises(ValueError, match="linear-attention state of 128 sequences"):
        LLM(loaded=loaded(model), kv_cache_memory=1 << 20, max_num_seqs=128)


def test_a_mixer_that_is_not_gated_deltanet_is_refused() -> None:
    model = tiny_architecture("qwen3_next")
    del model.model.layers[2].linear_attn.dt_bias
    with pytest.raises(ValueError, match=r"linear_attention layers \[0, 2\].*at \[0\]"):
        LLM(loaded=loaded(model), kv_cache_memory=2 << 20)


def test_state_slots_hand_out_copy_and_return() -> None:
    slots = StateSlots(3)
    a, b = slots.allocate("a"), slots.allocate("b")
    slots.fork("a", "a.1")
    assert slots.pending_copies == [(a, slots.slot("a.1"))]
    with pytest.raises(RuntimeError, match="all 3 state slots"):
        slots.allocate("c")
    slots.free("a.1")  # before its copy ran: the copy is dropped
    assert slots.take_copies() == [] and slots.num_free == 1
    slots.fork("b", "b.1")
    assert slots.take_copies() == [(b, slots.slot("b.1"))] and slots.take_copies() == []
    slots.check_integrity({"a", "b", "b.1"})
    with pytest.raises(AssertionError, match="state slots held by"):
        slots.check_integrity({"a", "b"})


def test_the_dashboard_state_shows_slots_beside_blocks(hybrid) -> None:
    from paged_serve.engine.observe.engine_state import take_state

    model, _ = hybrid
    engine = LLM(loaded=loaded(model), kv_cache_memory=4 << 20, max_num_seqs=8).engine
    engine.add_request(PROMPTS[2], GREEDY)
    engine.step()
    state = take_state(engine, None)
    assert (state.kv.state_slots_total, state.kv.state_slots_used) == (8, 1)
    assert (state.kv.state_snapshots_total, state.kv.state_snapshots_used) == (8, 0)
    [running] = state.running
    assert running.state_slot == engine.block_manager.state_slots.slot(running.id)
    assert state.kv.integrity == "ok"
