"""Llama 4's text model (``Llama4ForCausalLM``) in the engine, a tiny random-weight model built
from its own ``transformers`` config: three ``chunked_attention`` layers (chunks of 8 tokens,
shorter than the longer prompts, so every chunk bound cuts) and a full-attention NoPE layer
with attention temperature tuning, mixtures of experts (top-1 sigmoid router, a shared
expert) on layers 1 and 3 between dense ones. It runs HF's decoder forward (not the fast body),
its mixtures on the fused MoE.

Greedy tokens equal Hugging Face ``generate`` (fp32, eager) token for token: alone, batched
through 8-token prefill chunks with a prefix-cache hit (prompts of more than two attention
chunks), after a preemption, and on the triton backend's kernels with the decode-graph path.
The block pool is intact after every scenario.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from transformers import Llama4ForCausalLM, Llama4TextConfig, PreTrainedModel

from paged_serve.engine import LLM, SamplingParams
from paged_serve.engine.kv.kv_cache import KVCache, attention_layer_ids, cache_layout
from paged_serve.engine.model.architecture import decoder_model, runs_fast_body
from paged_serve.engine.runner.decode_graphs import DecodeGraphs, EagerReplay
from tests.conftest import TINY_VOCAB, assert_pool_clean, hf_greedy, loaded, random_prompts

CHUNK = 8  # tokens: attention_chunk_size
CONFIG = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=128,
    intermediate_size=256,
    intermediate_size_mlp=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=1024,
    initializer_range=0.1,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    num_local_experts=4,
    num_experts_per_tok=1,
    interleave_moe_layer_step=2,  # layers 1 and 3: experts; 0 and 2: dense
    attention_chunk_size=CHUNK,
    floor_scale=4,  # small, so the temperature changes within a prompt
    attn_scale=0.5,
    attn_temperature_tuning=True,
)
LENGTHS = [5, 19, 30]  # within one chunk, and more than two
MAX_TOKENS = 10
PREEMPTION_STEPS = 40  # tokens: enough for 3 requests to outgrow a pool of 6 blocks
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def tiny_llama4() -> PreTrainedModel:
    config = Llama4TextConfig(**CONFIG)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return Llama4ForCausalLM(config).eval()


@functools.cache
def reference() -> tuple[PreTrainedModel, list[list[int]], list[list[int]], list[list[int]]]:
    """``(model, prompts, want, long)``: the model, four prompts (the last shares 16 tokens with
    the second), HF's ``MAX_TOKENS`` greedy tokens for each and ``PREEMPTION_STEPS`` for the
    first three."""
    model = tiny_llama4()
    prompts = random_prompts(LENGTHS, seed=3)
    prompts.append(prompts[1][:16] + prompts[0])
    long = [hf_greedy(model, p, PREEMPTION_STEPS) for p in prompts[:3]]
    want = [t[:MAX_TOKENS] for t in long] + [hf_greedy(model, p, MAX_TOKENS) for p in prompts[3:]]
    return model, prompts, want, long


def test_the_tiny_model_has_what_the_tests_need() -> None:
    model = tiny_llama4()
    config = model.config
    assert config.layer_types == ["chunked_attention"] * 3 + ["full_attention"]
    assert list(config.no_rope_layers) == [1, 1, 1, 0]  # layer 3: NoPE
    assert list(config.moe_layers) == [1, 3]
    assert model.base_model is model and decoder_model(model) is model.model
    assert not runs_fast_body(model)


def test_install_moves_the_temperature_tuning_and_records_the_chunks() -> None:
    """The NoPE layer's own tuning is off in the engine's copy (its queries are scaled in the
    attention function); the RoPE layers never apply theirs."""
    model = reference()[0]
    llm = LLM(loaded=loaded(model), kv_cache_memory=4 << 20)
    layers = [layer.self_attn for layer in llm.engine.runner.model.model.layers]
    assert [a.paged_attention_chunk for a in layers] == [CHUNK, CHUNK, CHUNK, None]
    assert [a.attn_temperature_tuning for a in layers] == [True, True, True, False]
    assert [getattr(a, "paged_temperature", None) for a in layers] == [None] * 3 + [(4.0, 0.5)]
    assert all(layer.self_attn.attn_temperature_tuning for layer in model.model.layers[3:])


def test_the_mixtures_run_on_the_fused_moe(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers 1 and 3's ``Llama4TextMoe`` send each token to its chosen expert through the
    backend's fused MoE (one call per layer and step), not HF's every-expert pass."""
    model, prompts, want, _ = reference()
    llm = LLM(loaded=loaded(model), kv_cache_memory=4 << 20)
    runner = llm.engine.runner
    calls = []
    real = runner.backend.fused_moe

    def counted(hidden, *args, **kwargs):
        calls.append(hidden.shape[0])
        return real(hidden, *args, **kwargs)

    monkeypatch.setattr(runner, "backend", dataclasses.replace(runner.backend, fused_moe=counted))
    [result] = llm.generate([prompts[1]], SamplingParams(max_tokens=2, temperature=0.0))
    assert result.token_ids == want[1][:2]
    assert calls == [len(prompts[1])] * 2 + [1] * 2


def test_alone() -> None:
    model, prompts, want, _ = reference()
    llm = LLM(loaded=loaded(model), kv_cache_memory=4 << 20)
    for prompt, tokens in zip(prompts, want):
        [result] = llm.generate([prompt], GREEDY)
        assert result.token_ids == tokens
    assert_pool_clean(llm.engine.block_manager)


def test_batched_chunked_with_a_prefix_hit() -> None:
    """One batch, 8 tokens a step: prompts of up to four attention chunks in prefill chunks
    beside decodes (decode-only steps on the CPU C kernel, chunk bound in place); the last
    prompt's first block is the cache's."""
    model, prompts, want, _ = reference()
    llm = LLM(loaded=loaded(model), kv_cache_memory=4 << 20, max_num_batched_tokens=8)
    [first] = llm.generate([prompts[1]], GREEDY)
    results = llm.generate(prompts, GREEDY)
    assert first.token_ids == want[1]
    assert [r.token_ids for r in results] == want
    assert results[-1].metrics.num_cached_tokens >= 16
    assert_pool_clean(llm.engine.block_manager)


def test_preemption() -> None:
    """Three requests that grow to 3-5 blocks each in a pool of 6: some are preempted and
    recomputed (positions, hence temperatures and chunks, as before)."""
    model, prompts, _, want = reference()
    config = model.config
    block_bytes = KVCache.bytes_per_block(
        num_layers=len(attention_layer_ids(config)),
        block_size=16,
        layout=cache_layout(config),
        dtype=torch.float32,
    )
    llm = LLM(
        loaded=loaded(model),
        kv_cache_memory=6 * block_bytes,
        max_num_batched_tokens=64,
        max_num_seqs=8,
    )
    assert llm.engine.block_manager.num_blocks == 6
    params = SamplingParams(max_tokens=PREEMPTION_STEPS, temperature=0.0, ignore_eos=True)
    results = llm.generate(prompts[:3], params)
    assert [r.token_ids for r in results] == want
    assert llm.engine.scheduler.num_preemptions > 0
    assert_pool_clean(llm.engine.block_manager)


@pytest.mark.parametrize("num_kv_splits", [None, 2])
def test_the_kernels_in_the_engine_and_the_graph_path(
    num_kv_splits: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Triton backend (the interpreter), 8-token prefill chunks, then decode steps replayed
    through the graphs' static buffers (positions from the static row buffer): HF's tokens,
    with and without split-KV decode runs."""
    from paged_serve.kernels.triton import paged_attention as kernel

    if num_kv_splits is not None:
        monkeypatch.setattr(kernel, "choose_num_kv_splits", lambda **_: num_kv_splits)
    model, prompts, want, _ = reference()
    llm = LLM(
        loaded=loaded(model),
        kv_cache_memory=2 << 20,
        attention_backend="triton",
        max_num_batched_tokens=8,
        max_num_seqs=4,
    )
    engine = llm.engine
    graphs = DecodeGraphs(
        engine.runner.model,
        engine.runner.kv_cache,
        engine.runner.backend,
        max_batch_size=4,
        max_model_len=engine.max_model_len,
    )
    engine.runner.enable_decode_graphs(graphs, EagerReplay())
    tokens = 4
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    results = llm.generate(prompts[:3], params)
    assert [r.token_ids for r in results] == [w[:tokens] for w in want[:3]]
    assert sum(graphs.replays.values()) > 0
    assert_pool_clean(engine.block_manager)
