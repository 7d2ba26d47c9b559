"""Tensor parallelism over gloo on the CPU: a TP=2 engine gives the tokens of TP=1 and of Hugging
Face ``generate`` for every supported family, alone, batched, chunked, preempted, with prefix
hits and seeded n > 1; bad sizes are refused before any process starts; a worker that fails at
start-up is named with its cause; the step message survives its round trip.

One TP=2 engine per family serves every scenario (a worker's start costs seconds): its budget
splits a 100-token prompt into chunks (64 tokens a step) and its 12-block pool cannot hold the
whole batch at once, so the batched run preempts.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from paged_serve.engine import LLM, SamplingParams
from paged_serve.engine.config import EngineConfig
from paged_serve.engine.executor.workers import TensorParallelError, TensorParallelWorkers
from paged_serve.engine.model.fused_projections import fuse_projections
from paged_serve.engine.model.sharding import shard_model, shard_shape
from paged_serve.engine.platform.cpu.linears import speed_up_cpu_linears
from paged_serve.engine.platform.platform import platform_for
from paged_serve.engine.runner.step_inputs import StepInputs
from paged_serve.engine.runner.step_message import STEP, StepMessage, pack_step, unpack_step
from tests.conftest import (
    SWAPPED_DTYPES,
    TINY_FAMILIES,
    assert_pool_clean,
    hf_greedy,
    loaded,
    random_prompts,
)
from tests.conftest import tiny_model as build_tiny_model

LENGTHS = [1, 5, 15, 16, 17, 31, 40, 63, 100]
MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.95, n=3, seed=11, ignore_eos=True)
NUM_BLOCKS = 12
ENGINE_ARGS = {"max_num_batched_tokens": 64, "max_num_seqs": 16}


def block_bytes(config: object, tp: int) -> int:
    """Bytes of one fp32 block of 16 tokens on one rank of a TP=``tp`` engine."""
    kv_heads = config.num_key_value_heads // tp
    return config.num_hidden_layers * 2 * 16 * kv_heads * config.head_dim * 4


@pytest.fixture(scope="module", params=sorted(TINY_FAMILIES))
def family(request: pytest.FixtureRequest) -> Iterator[tuple]:
    """(family, HF model, prompts, HF greedy tokens, TP=1 LLM, TP=2 LLM), 12 blocks each."""
    model = build_tiny_model(request.param)
    prompts = random_prompts(LENGTHS, seed=1)
    want = [hf_greedy(model, p, MAX_TOKENS) for p in prompts]
    tp1_bytes = NUM_BLOCKS * block_bytes(model.config, 1)
    tp1 = LLM(loaded=loaded(model), kv_cache_memory=tp1_bytes, **ENGINE_ARGS)
    tp2 = LLM(
        loaded=loaded(model),
        tensor_parallel_size=2,
        kv_cache_memory=NUM_BLOCKS * block_bytes(model.config, 2),
        **ENGINE_ARGS,
    )
    try:
        yield request.param, model, prompts, want, tp1, tp2
    finally:
        tp2.shutdown()


def test_each_rank_holds_its_kv_heads_and_the_same_block_count(family):
    _, model, _, _, tp1, tp2 = family
    cache = tp2.engine.runner.kv_cache
    assert cache.num_blocks == tp1.engine.runner.kv_cache.num_blocks == NUM_BLOCKS
    assert cache.tensor.shape[-2] == model.config.num_key_value_heads // 2
    assert tp2.engine.runner.model.model.layers[0].self_attn.q_proj.out_features == 2 * 64
    assert all(p.is_alive() for p in tp2.engine.tp.processes.values())


def test_alone_equals_hf_and_tp1(family):
    _, _, prompts, want, tp1, tp2 = family
    for prompt, tokens in zip(prompts, want):
        [result] = tp2.generate([prompt], GREEDY)
        assert result.token_ids == tokens
    assert [r.token_ids for r in tp1.generate(prompts[:3], GREEDY)] == want[:3]
    assert_pool_clean(tp2.engine.block_manager)


def test_batched_chunked_and_preempted_equals_hf(family):
    _, _, prompts, want, _, tp2 = family
    preempted = tp2.engine.scheduler.num_preemptions
    results = tp2.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == want
    assert tp2.engine.scheduler.num_preemptions > preempted
    assert max(LENGTHS) > ENGINE_ARGS["max_num_batched_tokens"]  # the longest prompt is chunked
    assert_pool_clean(tp2.engine.block_manager)


def test_prefix_cache_hits_give_the_same_tokens(family):
    _, model, prompts, _, _, tp2 = family
    shared = prompts[7][:48]
    follow_ups = [shared + [1, 2, 3], shared + [4, 5]]
    hits = tp2.engine.scheduler.prefix_hit_tokens
    tp2.generate([shared], GREEDY)
    results = [tp2.generate([p], GREEDY)[0] for p in follow_ups]
    assert tp2.engine.scheduler.prefix_hit_tokens >= hits + 2 * 32
    assert [r.token_ids for r in results] == [hf_greedy(model, p, MAX_TOKENS) for p in follow_ups]
    assert_pool_clean(tp2.engine.block_manager)


def test_seeded_n3_equals_tp1(family):
    _, _, prompts, _, tp1, tp2 = family
    chosen = [prompts[2], prompts[6]]
    want = [r.token_ids for r in tp1.generate(chosen, SEEDED)]
    got = [r.token_ids for r in tp2.generate(chosen, SEEDED)]
    assert got == want
    assert len(got) == 6 and len({tuple(t) for t in got}) > 1  # the samples differ
    assert_pool_clean(tp2.engine.block_manager)


def test_verified_drafts_equal_hf(family):
    """Speculation on the driver, verification rows on both ranks: partly wrong drafts change
    no token (the TP=2 engine's own prompt lookup rarely fires on random weights)."""
    from tests.engine.spec.test_speculative import ScriptedDrafter

    _, model, prompts, want, _, tp2 = family
    speculator = tp2.engine.speculator
    drafter, speculator.drafter = speculator.drafter, ScriptedDrafter(
        {}, int(model.config.vocab_size)
    )
    try:
        accepted = speculator.stats.num_accepted_tokens
        for i, (prompt, tokens) in enumerate(zip(prompts[:4], want)):
            speculator.drafter.answers = {f"d{i}": tokens}
            tp2.engine.add_request(prompt, GREEDY, request_id=f"d{i}")
            got = []
            while tp2.engine.has_unfinished:
                for out in tp2.engine.step():
                    got += out.new_token_ids
            assert got == tokens
        assert speculator.stats.num_accepted_tokens > accepted
    finally:
        speculator.drafter = drafter
    assert_pool_clean(tp2.engine.block_manager)


# ------------------------------------------------------------------ configurations refused
def test_size_zero_is_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1.*got 0"):
        EngineConfig(tensor_parallel_size=0)


def mha_llama() -> LlamaForCausalLM:
    """A tiny Llama with 4 query and 4 KV heads (no GQA)."""
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
    )
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize(
    ("model", "size", "message"),
    [
        ("gqa", 4, "tensor_parallel_size 4 is more than the model's 2 KV heads"),
        ("mha", 3, "tensor_parallel_size 3 does not divide the model's 4 attention heads"),
    ],
)
def test_sizes_the_heads_do_not_allow_are_refused_before_any_process_starts(model, size, message):
    hf = build_tiny_model("llama") if model == "gqa" else mha_llama()
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match=message):
        LLM(loaded=loaded(hf), tensor_parallel_size=size)
    assert set(multiprocessing.active_children()) <= before


def test_shard_shape_names_the_mlp_width():
    config = build_tiny_model("llama").config
    config.intermediate_size = 255
    with pytest.raises(ValueError, match="does not divide the model's 255 MLP intermediate size"):
        shard_shape(config, 2)


def test_a_worker_that_fails_at_start_up_is_named_with_its_cause(tmp_path):
    """The worker loads ``config.model`` itself (no shared model) from a folder with nothing."""
    config = EngineConfig(model=str(tmp_path / "missing"), tensor_parallel_size=2)
    model = build_tiny_model("llama")
    before = set(multiprocessing.active_children())  # another module fixture's worker may run
    failed = r"rank 1 \(pid \d+\) failed at start-up: OSError"
    with pytest.raises(TensorParallelError, match=failed):
        TensorParallelWorkers.start(
            config, model, platform_for(torch.device("cpu")), max_model_len=64, share_model=False
        )
    assert set(multiprocessing.active_children()) <= before


# ------------------------------------------------------------------ the step message
def vars_of(inputs: StepInputs) -> dict:
    return {name: getattr(inputs, name) for name in StepInputs.__dataclass_fields__}


def test_step_message_round_trip():
    inputs = StepInputs(
        input_ids=[5, 6, 7, 8],
        positions=[0, 1, 2, 9],
        slots=[32, 33, 34, 9],
        cu_seqlens=[0, 3, 4],
        seq_lens=[3, 10],
        block_tables=[[2], [0, 7]],
        logit_rows=[2, 3, 3],
    )
    message = StepMessage(STEP, [(1, 4), (7, 9)], inputs)
    assert unpack_step(pack_step(message)) == message
    hybrid = StepMessage(  # a hybrid model's step: state slots, fresh flags, fork copies
        STEP,
        [],
        StepInputs(**{**vars_of(inputs), "state_slots": [3, 0], "has_state": [0, 1]}),
        [(0, 5)],
    )
    assert unpack_step(pack_step(hybrid)) == hybrid
    assert unpack_step(pack_step(StepMessage.shutdown())) == StepMessage.shutdown()
    with pytest.raises(ValueError, match="malformed step message"):
        unpack_step(pack_step(message)[:-1])


@pytest.mark.parametrize("dtype", SWAPPED_DTYPES)
def test_a_model_prepared_for_one_cpu_shards_its_original_projections(
    dtype: torch.dtype, two_threads: None
) -> None:
    """Fused, then split over the cores (fp32) or packed for oneDNN (bf16): sharding puts the
    plain projections back first, so each rank holds its rows of the original weights."""
    model = build_tiny_model("qwen2").to(dtype)
    original = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    fuse_projections(model)
    assert speed_up_cpu_linears(model) > 0
    shard_model(model, rank=1, world_size=2)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert type(q_proj) is torch.nn.Linear
    assert torch.equal(q_proj.weight, original[original.shape[0] // 2 :])
