"""State-space and short-convolution models in the engine, each a tiny random-weight model built
from its own ``transformers`` config: Mamba-2 hybrids (Bamba, Granite 4.0 hybrid with experts,
Nemotron-H with a feed-forward-only layer, Falcon-H1 with attention and Mamba-2 side by side and
its multipliers), a pure Mamba-2 model (no attention layer, no KV) and LFM2 (gated short
convolutions, dense and MoE).

Greedy tokens equal Hugging Face ``generate`` (fp32) token for token: alone, batched through
8-token prefill chunks (each chunk continues from the state its previous chunk left in the slot),
after a preemption (the state recomputed from the prompt), and on the triton backend's kernels
with the decode-graph path (padding rows on the scratch slot). A seeded ``n = 2`` fork starts
from its parent's state. The block pool and the state slots are intact after every scenario.
"""

from __future__ import annotations

import functools

import pytest
import torch
import transformers as tf

from paged_serve.engine import LLM, SamplingParams
from paged_serve.engine.kv.kv_cache import KVCache, attention_layer_ids, cache_layout
from paged_serve.engine.kv.state_cache import StateCache
from paged_serve.engine.model.mamba_mixer import mamba_state_shape
from paged_serve.engine.model.short_conv import short_conv_state_shape
from paged_serve.engine.runner.decode_graphs import DecodeGraphs, EagerReplay
from tests.conftest import TINY_VOCAB, assert_pool_clean, hf_greedy, loaded, random_prompts

COMMON = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.1,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
# Mamba-2 mixers: 8 heads of 16 lanes over 2 groups of a 12-wide state (not a power of two)
MAMBA = dict(
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_n_groups=2,
    mamba_d_state=12,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=16,
)
MOE = dict(num_experts_per_tok=2)
FAMILIES: dict[str, tuple[type, type, dict]] = {
    "bamba": (tf.BambaConfig, tf.BambaForCausalLM, {**MAMBA, "attn_layer_indices": [1]}),
    "granitemoehybrid": (
        tf.GraniteMoeHybridConfig,
        tf.GraniteMoeHybridForCausalLM,
        {
            **MAMBA,
            **MOE,
            "layer_types": ["mamba", "attention", "mamba"],
            "num_local_experts": 4,
            "shared_intermediate_size": 64,
            "embedding_multiplier": 12.0,
            "residual_multiplier": 0.22,
            "attention_multiplier": 0.05,
            "logits_scaling": 4.0,
        },
    ),
    "nemotron_h": (
        tf.NemotronHConfig,
        tf.NemotronHForCausalLM,
        {
            "num_hidden_layers": 4,
            "layers_block_type": ["mamba", "attention", "mlp", "mamba"],
            "mamba_num_heads": 8,
            "mamba_head_dim": 16,
            "n_groups": 2,
            "ssm_state_size": 12,
            "conv_kernel": 4,
            "expand": 2,
            "chunk_size": 16,
            "head_dim": 16,
        },
    ),
    "falcon_h1": (
        tf.FalconH1Config,
        tf.FalconH1ForCausalLM,
        {
            **MAMBA,
            "mamba_d_ssm": 128,
            "head_dim": 16,
            "ssm_in_multiplier": 0.7,
            "ssm_multipliers": [1.1, 0.9, 1.2, 0.8, 1.3],
            "attention_in_multiplier": 0.9,
            "attention_out_multiplier": 1.1,
            "key_multiplier": 0.8,
            "mlp_multipliers": [1.2, 0.9],
            "lm_head_multiplier": 0.5,
            "embedding_multiplier": 2.0,
        },
    ),
    "mamba2": (
        tf.Mamba2Config,
        tf.Mamba2ForCausalLM,
        {
            "num_hidden_layers": 2,
            "num_heads": 8,
            "head_dim": 16,
            "n_groups": 2,
            "state_size": 12,
            "conv_kernel": 4,
            "expand": 2,
            "chunk_size": 16,
        },
    ),
    "lfm2": (
        tf.Lfm2Config,
        tf.Lfm2ForCausalLM,
        {"layer_types": ["conv", "full_attention", "conv"], "conv_L_cache": 3},
    ),
    "lfm2_moe": (
        tf.Lfm2MoeConfig,
        tf.Lfm2MoeForCausalLM,
        {
            **MOE,
            "layer_types": ["conv", "full_attention", "conv"],
            "conv_L_cache": 3,
            "num_experts": 4,
            "moe_intermediate_size": 32,
            "num_dense_layers": 1,
        },
    ),
}
MAMBA2_ONLY = {"vocab_size", "hidden_size", "tie_word_embeddings", "pad_token_id"}
MAMBA2_ONLY |= {"bos_token_id", "eos_token_id", "initializer_range"}
PROMPTS = random_prompts([1, 9, 23, 37], seed=5)
STEPS = 6
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)


def tiny_family(name: str) -> tf.PreTrainedModel:
    config_cls, model_cls, extra = FAMILIES[name]
    common = COMMON if name != "mamba2" else {k: COMMON[k] for k in MAMBA2_ONLY}
    config = config_cls(**{**common, **extra})
    config._attn_implementation = "eager"
    if name == "mamba2":  # a pure SSM has no context limit: the engine's comes from the config
        config.max_position_embeddings = COMMON["max_position_embeddings"]
    torch.manual_seed(0)
    return model_cls(config).eval()


@functools.cache
def reference(name: str) -> tuple[tf.PreTrainedModel, list[list[int]]]:
    model = tiny_family(name)
    return model, [hf_greedy(model, p, STEPS) for p in PROMPTS]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest):
    return reference(request.param)


def test_alone_and_batched_through_chunks(family) -> None:
    model, want = family
    llm = LLM(loaded=loaded(model), kv_cache_memory=4 << 20, max_num_seqs=8)
    assert [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS] == want
    chunked = LLM(
        loaded=loaded(model), kv_cache_memory=4 << 20, max_num_batched_tokens=8, max_num_seqs=8
    )
    assert [r.token_ids for r in chunked.generate(PROMPTS, GREEDY)] == want
    for engine in (llm.engine, chunked.engine):
        assert_pool_clean(engine.block_manager)
        slots = engine.block_manager.state_slots
        assert slots.num_free == slots.num_slots


def _state_bytes(model: tf.PreTrainedModel, max_num_seqs: int) -> int:
    shape = mamba_state_shape(model) or short_conv_state_shape(model)
    cache = StateCache(
        shape, num_slots=max_num_seqs, dtype=torch.float32, device="cpu", num_snapshots=8
    )
    return cache.num_bytes


def test_preemption_recomputes_the_state(family) -> None:
    """Three requests that grow to 3 blocks each in a pool of 5: some are preempted, and their
    states rebuilt from the prompt and the tokens drawn so far."""
    model, _ = family
    config = model.config
    if not attention_layer_ids(config):
        pytest.skip("a model without attention layers has no KV blocks to run out of")
    prompts = [p + p[:8] for p in PROMPTS[1:4]]
    want = [hf_greedy(model, p, 12) for p in prompts]
    block_bytes = KVCache.bytes_per_block(
        num_layers=len(attention_layer_ids(config)),
        block_size=16,
        layout=cache_layout(config),
        dtype=torch.float32,
    )
    llm = LLM(
        loaded=loaded(model),
        kv_cache_memory=5 * block_bytes + _state_bytes(model, max_num_seqs=8),
        max_num_batched_tokens=64,
        max_num_seqs=8,
    )
    assert llm.engine.block_manager.num_blocks == 5
    results = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert [r.token_ids for r in results] == want
    assert llm.engine.scheduler.num_preemptions > 0
    assert_pool_clean(llm.engine.block_manager)


def test_forks_start_from_their_parents_state(family) -> None:
    model, _ = family
    llm = LLM(loaded=loaded(model), kv_cache_memory=4 << 20, max_num_seqs=8)
    sampled = dict(max_tokens=8, temperature=1.0, ignore_eos=True)
    forked = llm.generate([PROMPTS[2]], SamplingParams(n=2, seed=7, **sampled))
    alone = [llm.generate([PROMPTS[2]], SamplingParams(seed=s, **sampled))[0] for s in (7, 8)]
    assert [r.token_ids for r in forked] == [r.token_ids for r in alone]
    assert_pool_clean(llm.engine.block_manager)


@pytest.mark.parametrize("name", ["bamba", "lfm2"])
def test_the_kernels_in_the_engine_and_the_graph_path(name: str) -> None:
    """Triton backend (the interpreter), 16-token prefill chunks, then decode steps replayed
    through the graphs' static buffers (padding rows on the scratch slot): HF's tokens."""
    model, want = reference(name)
    llm = LLM(
        loaded=loaded(model),
        kv_cache_memory=2 << 20,
        attention_backend="triton",
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    engine = llm.engine
    graphs = DecodeGraphs(
        engine.runner.model,
        engine.runner.kv_cache,
        engine.runner.backend,
        max_batch_size=4,
        max_model_len=engine.max_model_len,
        state_cache=engine.runner.state_cache,
    )
    engine.runner.enable_decode_graphs(graphs, EagerReplay())
    tokens = 3
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    results = llm.generate(PROMPTS[1:4], params)
    assert [r.token_ids for r in results] == [w[:tokens] for w in want[1:4]]
    assert sum(graphs.replays.values()) > 0
    assert_pool_clean(engine.block_manager)


def test_state_shapes_and_no_kv_for_stateful_layers() -> None:
    """Nemotron-H: KV only for its attention layer (not the Mamba-2 or the MLP-only layers);
    Mamba-2 states ``[H, P, N]`` fp32 and windows of ``H P + 2 G N`` channels. LFM2: windows of
    ``hidden`` channels, no recurrent state. A pure Mamba-2 model: no KV layer at all."""
    nemotron = LLM(loaded=loaded(reference("nemotron_h")[0]), kv_cache_memory=4 << 20)
    runner = nemotron.engine.runner
    assert runner.kv_cache.tensor.shape[0] == 1
    conv, ssm = runner.state_cache.layer(3)
    assert conv.shape[1:] == (3, 128 + 2 * 2 * 12) and ssm.shape[1:] == (8, 16, 12)
    assert ssm.dtype == torch.float32
    lfm2 = LLM(loaded=loaded(reference("lfm2")[0]), kv_cache_memory=4 << 20)
    window, recurrent = lfm2.engine.runner.state_cache.layer(2)
    assert window.shape[1:] == (2, 64) and recurrent.numel() == 0
    mamba = LLM(loaded=loaded(reference("mamba2")[0]), kv_cache_memory=4 << 20)
    assert mamba.engine.runner.kv_cache.tensor.shape[0] == 0


@pytest.mark.parametrize("name", ["bamba", "falcon_h1"])
def test_tensor_parallel_equals_one_rank(name: str) -> None:
    """TP=2 (gloo): each rank holds half the Mamba-2 heads, one of the two groups and their
    states (Falcon-H1: beside half the attention heads, its multipliers' rows cut alike);
    seeded n = 2 samples through 8-token chunks equal TP=1's."""
    model, _ = reference(name)
    params = SamplingParams(max_tokens=6, temperature=1.0, n=2, seed=3, ignore_eos=True)
    kwargs = dict(kv_cache_memory=4 << 20, max_num_batched_tokens=8, max_num_seqs=8)
    want = [r.token_ids for r in LLM(loaded=loaded(model), **kwargs).generate(PROMPTS, params)]
    tp2 = LLM(loaded=loaded(model), tensor_parallel_size=2, **kwargs)
    try:
        conv, ssm = tp2.engine.runner.state_cache.layer(0)
        lanes = model.model.layers[0].mamba.intermediate_size // 2
        assert ssm.shape[1:] == (4, 16, 12) and conv.shape[-1] == lanes + 2 * 12
        assert [r.token_ids for r in tp2.generate(PROMPTS, params)] == want
        assert_pool_clean(tp2.engine.block_manager)
    finally:
        tp2.shutdown()


@pytest.mark.parametrize(
    "name,reason",
    [
        ("lfm2", "short-convolution"),
        ("granitemoehybrid", "no feed-forward block it knows"),
        ("mamba2", "has none"),
    ],
)
def test_tensor_parallel_refuses_what_it_cannot_shard(name: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        LLM(loaded=loaded(reference(name)[0]), tensor_parallel_size=2)
