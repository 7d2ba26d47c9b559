"""The architectures people serve, each as a tiny random-weight model built from its own
``transformers`` config: greedy tokens equal Hugging Face ``generate`` (fp32, eager attention,
which honours soft-capping and sinks) token for token, alone, batched with prompts of
different lengths through chunked prefill and a prefix-cache hit, and after a preemption.
The block pool is intact after every scenario."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import (
    CohereConfig,
    CohereForCausalLM,
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    Glm4MoeLiteConfig,
    Glm4MoeLiteForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedModel,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

from paged_serve.engine import LLM, SamplingParams
from paged_serve.engine.kv.kv_cache import KVCache, attention_layer_ids, cache_layout
from paged_serve.engine.kv.state_cache import linear_layer_ids
from tests.conftest import TINY_VOCAB, assert_pool_clean, hf_greedy, loaded, random_prompts

COMMON = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=1024,
    initializer_range=0.1,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
WINDOW = 8  # tokens: shorter than most prompts, so the sliding layers cut
MOE = dict(moe_intermediate_size=64, num_experts_per_tok=2)
# Multi-head latent attention: a 32-lane latent and a 16-lane shared rope key per token; query
# and value head sizes unlike each other and unlike the latent's.
MLA = dict(
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=24,
    head_dim=16,  # the rope part: what HF's rotary embedding reads
    n_routed_experts=8,
    n_shared_experts=1,
    first_k_dense_replace=1,  # layer 0 dense, layer 1 mixture-of-experts
    **MOE,
)
# Hybrid linear attention: gated DeltaNet layers 0 and 2 around a full-attention layer, with
# grouped value heads (4 over 2 key heads) and value heads wider than key heads.
HYBRID = dict(
    num_hidden_layers=3,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=24,
    linear_conv_kernel_dim=4,
)
ARCHITECTURES: dict[str, tuple[type, type, dict]] = {
    "phi3": (Phi3Config, Phi3ForCausalLM, {}),
    "olmo2": (Olmo2Config, Olmo2ForCausalLM, {}),
    "smollm3": (SmolLM3Config, SmolLM3ForCausalLM, {"no_rope_layers": [1, 0]}),  # layer 1 NoPE
    "granite": (
        GraniteConfig,
        GraniteForCausalLM,
        {
            "embedding_multiplier": 12.0,
            "residual_multiplier": 0.22,
            "attention_multiplier": 0.05,
            "logits_scaling": 4.0,
        },
    ),
    "cohere": (CohereConfig, CohereForCausalLM, {"logit_scale": 0.25}),  # LayerNorm, logit_scale
    "gemma2": (
        Gemma2Config,
        Gemma2ForCausalLM,
        {
            "sliding_window": WINDOW,
            "attn_logit_softcapping": 5.0,  # small, so that the cap bends real scores
            "final_logit_softcapping": 3.0,
            "query_pre_attn_scalar": 24,
        },
    ),
    "gemma3": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        {
            "head_dim": 256,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 256,
        },
    ),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, {"num_experts": 4, **MOE}),
    "qwen2_moe": (  # a shared expert beside the routed ones, behind its own sigmoid gate
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        {"num_experts": 4, "shared_expert_intermediate_size": 128, **MOE},
    ),
    "glm4_moe": (  # DeepSeek's router: sigmoid scores, a correction bias, group-limited top-k
        Glm4MoeConfig,
        Glm4MoeForCausalLM,
        {
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "n_group": 2,
            "topk_group": 1,
            "first_k_dense_replace": 1,  # layer 0 dense, layer 1 mixture-of-experts
            **MOE,
        },
    ),
    "deepseek_v3": (  # MLA with a low-rank query, and DeepSeek's group-limited router
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        {"q_lora_rank": 48, "n_group": 2, "topk_group": 1, **MLA},
    ),
    "deepseek_v2": (  # MLA with a full-rank query; complex-number rotary embedding
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        {"q_lora_rank": None, "n_group": 2, "topk_group": 1, **MLA},
    ),
    "glm4_moe_lite": (  # MLA whose latent and query are scaled (its LoRA scales)
        Glm4MoeLiteConfig,
        Glm4MoeLiteForCausalLM,
        {"q_lora_rank": 48, "n_group": 2, "topk_group": 1, **MLA},
    ),
    "qwen3_next": (  # gated DeltaNet + gated full attention; routed and shared experts
        Qwen3NextConfig,
        Qwen3NextForCausalLM,
        {"num_experts": 4, "shared_expert_intermediate_size": 64, **MOE, **HYBRID},
    ),
    "qwen3_5": (Qwen3_5TextConfig, Qwen3_5ForCausalLM, HYBRID),  # separate input projections
    "qwen3_5_moe": (  # the same hybrid with routed and shared experts
        Qwen3_5MoeTextConfig,
        Qwen3_5MoeForCausalLM,
        {"num_experts": 4, "shared_expert_intermediate_size": 64, **MOE, **HYBRID},
    ),
    "mixtral": (MixtralConfig, MixtralForCausalLM, {"num_local_experts": 4, **MOE}),
    "olmoe": (OlmoeConfig, OlmoeForCausalLM, {"num_experts": 4, **MOE}),
    "gpt_oss": (
        GptOssConfig,
        GptOssForCausalLM,
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
}
LENGTHS = [1, 6, 17, 33]
MAX_TOKENS = 12
PREEMPTION_STEPS = 40  # tokens: enough for 3 requests to outgrow a pool of 6 blocks
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def tiny_architecture(name: str, seed: int = 0) -> PreTrainedModel:
    config_cls, model_cls, extra = ARCHITECTURES[name]
    config = config_cls(**{**COMMON, **extra})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    for module in model.modules():  # parameters that start at zero: make them matter
        if name == "gpt_oss" and hasattr(module, "sinks"):
            torch.nn.init.normal_(module.sinks, std=1.0)
        if hasattr(module, "e_score_correction_bias"):
            torch.nn.init.normal_(module.e_score_correction_bias, std=0.5)
    return model


@functools.cache
def reference(
    name: str,
) -> tuple[PreTrainedModel, list[list[int]], list[list[int]], list[list[int]]]:
    """``(model, prompts, want, long)``: the tiny model, five prompts, HF's ``MAX_TOKENS``
    greedy tokens for each and its ``PREEMPTION_STEPS`` for the first three (computed once per
    architecture: the fixture and the tensor-parallel test share them)."""
    model = tiny_architecture(name)
    prompts = random_prompts(LENGTHS, seed=3)
    prompts.append(prompts[-1][:20] + prompts[1])  # shares 20 tokens (a cached block) with one
    # greedy is a prefix of itself: the preemption test's 40 tokens give the first prompts' 12
    long = [hf_greedy(model, p, PREEMPTION_STEPS) for p in prompts[:3]]
    want = [t[:MAX_TOKENS] for t in long] + [hf_greedy(model, p, MAX_TOKENS) for p in prompts[3:]]
    return model, prompts, want, long


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def expected(request: pytest.FixtureRequest):
    return reference(request.param)


def test_alone(expected) -> None:
    model, prompts, want, _ = expected
    llm = LLM(loaded=loaded(model), kv_cache_memory=4 << 20)
    for prompt, tokens in zip(prompts, want):
        [result] = llm.generate([prompt], GREEDY)
        assert result.token_ids == tokens
    assert_pool_clean(llm.engine.block_manager)


def test_batched_chunked_with_a_prefix_hit(expected) -> None:
    """One batch, 8 tokens a step: long prompts in chunks beside decodes; the last prompt's
    first block is the cache's (the previous prompt filled it)."""
    model, prompts, want, _ = expected
    llm = LLM(loaded=loaded(model), kv_cache_memory=4 << 20, max_num_batched_tokens=8)
    [first] = llm.generate([prompts[-2]], GREEDY)
    results = llm.generate(prompts, GREEDY)
    assert first.token_ids == want[-2]
    assert [r.token_ids for r in results] == want
    if linear_layer_ids(model.config):  # a hybrid's state is kept only every 256 tokens
        assert results[-1].metrics.num_cached_tokens == 0
    else:
        assert results[-1].metrics.num_cached_tokens >= 16
    assert_pool_clean(llm.engine.block_manager)


def test_preemption(expected) -> None:
    """Three requests that grow to 3-4 blocks each in a pool of 6: the running ones outgrow it,
    so some are preempted and recomputed."""
    model, prompts, _, want = expected
    prompts, steps = prompts[:3], PREEMPTION_STEPS
    hf = model.config
    layout = cache_layout(hf)
    block_bytes = KVCache.bytes_per_block(
        num_layers=len(attention_layer_ids(hf)), block_size=16, layout=layout, dtype=torch.float32
    )
    llm = LLM(
        loaded=loaded(model),
        kv_cache_memory=6 * block_bytes + state_bytes(model, max_num_seqs=8),
        max_num_batched_tokens=64,
        max_num_seqs=8,
    )
    assert llm.engine.block_manager.num_blocks == 6
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    results = llm.generate(prompts, params)
    assert [r.token_ids for r in results] == want
    assert llm.engine.scheduler.num_preemptions > 0
    assert_pool_clean(llm.engine.block_manager)


def state_bytes(model: PreTrainedModel, max_num_seqs: int) -> int:
    """What a hybrid model's state slots and snapshot rows (as many as slots, the default)
    take of the KV budget (0 for other models)."""
    from paged_serve.engine.kv.state_cache import StateCache, linear_state_shape

    shape = linear_state_shape(model.config)
    if shape is None:
        return 0
    cache = StateCache(
        shape, num_slots=max_num_seqs, dtype=torch.float32, device="cpu", num_snapshots=max_num_seqs
    )
    return cache.num_bytes


def test_logprobs_and_prompt_logprobs_follow_the_models_head(expected) -> None:
    """The logprobs the engine reports are HF's ``log_softmax`` of its logits, the family's
    logit transforms included (Granite's scaling, Gemma's final soft-cap): greedy tokens alone
    cannot tell, since both transforms keep the order."""
    model, prompts, _, _ = expected
    prompt = prompts[2]
    with torch.inference_mode():
        hf = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    llm = LLM(loaded=loaded(model), kv_cache_memory=4 << 20)
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2, prompt_logprobs=0)
    [result] = llm.generate([prompt], params)
    [first] = result.logprobs
    assert first.logprob == pytest.approx(hf[-1, first.token_id].item(), abs=1e-4)
    assert [t for t, _ in first.top] == hf[-1].topk(2).indices.tolist()
    scored = [entry.logprob for entry in result.prompt_logprobs[1:]]
    want = hf[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].tolist()
    assert scored == pytest.approx(want, abs=1e-4)
    assert_pool_clean(llm.engine.block_manager)


@pytest.mark.parametrize(
    "name",
    [
        "gemma2", "gemma3", "qwen3_moe", "mixtral", "qwen2_moe", "glm4_moe", "gpt_oss",
        "deepseek_v3", "qwen3_next", "qwen3_5", "qwen3_5_moe",
    ],
)  # fmt: skip
def test_tensor_parallel_equals_hf(name: str) -> None:
    """TP=2 over gloo: soft-capping, sliding layers and Gemma's scalings hold on sharded heads;
    the experts' width is sharded and their partial sums all-reduced; shared experts are
    sharded as dense MLPs beside them; gpt-oss's sinks, biases and interleaved transposed
    experts are sliced per rank; latent attention's heads are sharded over a replicated
    latent cache; gated DeltaNet's key and value heads (and their state slots) are sharded."""
    model, prompts, want, _ = reference(name)
    prompts, want = prompts[: len(LENGTHS)], want[: len(LENGTHS)]
    tp2 = LLM(loaded=loaded(model), tensor_parallel_size=2, kv_cache_memory=4 << 20)
    try:
        assert [r.token_ids for r in tp2.generate(prompts, GREEDY)] == want
        assert_pool_clean(tp2.engine.block_manager)
    finally:
        tp2.shutdown()


@pytest.mark.parametrize(
    "name,missing",
    [
        ("olmo2", "q_norm normalises over all heads"),
        ("phi3", r"no \['q_proj', 'k_proj', 'v_proj'\] Linear"),
    ],
)
def test_tensor_parallel_refuses_what_it_cannot_shard(name: str, missing: str) -> None:
    """Before any worker process starts, naming what the module swap cannot shard."""
    with pytest.raises(ValueError, match=missing):
        LLM(loaded=loaded(tiny_architecture(name)), tensor_parallel_size=2)


def test_seeded_n2_sampling_is_batch_invariant(expected) -> None:
    """n=2 seeded samples of a prompt (forked from one prefill, copy-on-write) are the same
    alone and beside other requests."""
    model, prompts, _, _ = expected
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, n=2, seed=7, ignore_eos=True)
    llm = LLM(loaded=loaded(model), kv_cache_memory=4 << 20)
    alone = [r.token_ids for r in llm.generate([prompts[2]], params)]
    batched = llm.generate(prompts[:4], params)
    assert [r.token_ids for r in batched[4:6]] == alone
    assert alone[0] != alone[1]  # the two samples differ
    assert_pool_clean(llm.engine.block_manager)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_each_family_runs_the_body(name: str) -> None:
    """Every covered family runs engine/model/body/: none falls back to HF's forward unnoticed."""
    llm = LLM(loaded=loaded(tiny_architecture(name)), kv_cache_memory=4 << 20)
    assert llm.engine.runner.body is not None


def test_a_partial_rotary_embedding() -> None:
    """Phi-3 with half of each head's lanes rotated, on the body: HF's tokens."""
    config_cls, model_cls, extra = ARCHITECTURES["phi3"]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**COMMON, **extra, "partial_rotary_factor": 0.5})).eval()
    llm = LLM(loaded=loaded(model), kv_cache_memory=4 << 20)
    assert llm.engine.runner.body is not None
    prompts = random_prompts([6, 17], seed=3)
    got = [r.token_ids for r in llm.generate(prompts, GREEDY)]
    assert got == [hf_greedy(model, p, MAX_TOKENS) for p in prompts]
