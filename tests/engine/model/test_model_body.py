"""``ModelBody`` (engine/model/body/) equals Hugging Face's own forward of the same prepared
model bit for bit: every family it runs (the dense ones, Phi-3's own fused projections, OLMo 2's
post-norms, SmolLM3's NoPE layers, Granite's multipliers, the mixtures of experts), fp32 and bf16,
projections fused or apart, int4 weights, sliding windows, over prefill chunks, mixed steps and
decode steps. Each step of a real engine
runs both and compares their hidden states; the KV cache gets the same values either way."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import paged_serve.engine.model.prep as model_prep
from paged_serve.engine.llm import LLM
from paged_serve.engine.model.body import RMSNorm
from paged_serve.engine.sampling_params import SamplingParams
from tests.conftest import (
    TINY_FAMILIES,
    assert_pool_clean,
    hf_greedy,
    loaded,
    random_prompts,
    tiny_model,
)
from tests.engine.model.test_model_coverage import ARCHITECTURES, COMMON, tiny_architecture


def _run_both(llm: LLM, prompts: list[list[int]], max_tokens: int = 6) -> int:
    """Generate with every step's body computed by ``ModelBody`` and by HF's forward, asserting
    they are equal; returns the number of steps compared."""
    runner = llm.engine.runner
    body, hidden_states = runner.body, runner.hidden_states
    assert body is not None
    compared = []

    def both(inputs, images=None):
        # A hybrid's gated DeltaNet layers advance their state slots: both runs start from the
        # same state (the KV slots are rewritten with the same values).
        states = runner.state_cache
        saved = None if states is None else (states.conv.clone(), states.recurrent.clone())
        runner.body = None
        theirs = hidden_states(inputs, images)
        if saved is not None:
            states.conv.copy_(saved[0])
            states.recurrent.copy_(saved[1])
        runner.body = body
        ours = hidden_states(inputs, images)
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
        assert torch.equal(ours, theirs), f"step {len(compared)}"
        compared.append(len(inputs.input_ids))
        return ours

    runner.hidden_states = both
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params)
    assert_pool_clean(llm.engine.block_manager)
    assert any(n > len(prompts) for n in compared)  # some step carried prompt chunks
    assert len(prompts) in compared  # and some step was decode rows only
    return len(compared)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_equals_hf_forward_bit_for_bit(family: str, dtype: torch.dtype) -> None:
    model = tiny_model(family).to(dtype)
    # A small token budget chunks the prompts and mixes chunks with decode rows.
    llm = LLM(loaded=loaded(model), max_num_batched_tokens=24)
    assert _run_both(llm, random_prompts([5, 30, 17], seed=1)) > 6


# The coverage suite's families the body runs besides TINY_FAMILIES (architecture.py).
BODY_FAMILIES = [
    *("phi3", "olmo2", "smollm3", "granite", "gemma2", "gemma3", "cohere"),
    *("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss", "glm4_moe"),
    *("deepseek_v3", "deepseek_v2", "glm4_moe_lite", "qwen3_next", "qwen3_5", "qwen3_5_moe"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", BODY_FAMILIES)
def test_other_families_equal_hf_forward_bit_for_bit(name: str, dtype: torch.dtype) -> None:
    llm = LLM(loaded=loaded(tiny_architecture(name).to(dtype)), max_num_batched_tokens=24)
    if name in ("phi3", "glm4_moe"):
        # HF's partial rotary embedding (Phi-3's and GLM-4.5's form, whatever the width)
        # concatenates q into [heads, T, D] order, which the C decode kernel does not take (it
        # reads each row's heads contiguous), so HF's forward attends decode rows through the
        # plan while the body's q suits the kernel: another order of sums. Both through the
        # plan, the rest must match bit for bit.
        llm.engine.runner.backend.paged_attention.__self__.decode_kernel = None
    assert _run_both(llm, random_prompts([5, 30, 17], seed=1)) > 6


def test_olmoe_clip_qkv() -> None:
    """OLMoE clamps q, k and v after its norms: a bound small enough to cut real values."""
    config_cls, model_cls, extra = ARCHITECTURES["olmoe"]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**COMMON, **extra, "clip_qkv": 0.3})).eval()
    llm = LLM(loaded=loaded(model), max_num_batched_tokens=24)
    assert llm.engine.runner.body.layers[0].attention.clip == 0.3
    _run_both(llm, random_prompts([5, 30, 17], seed=5))


def test_cohere_qk_norms() -> None:
    """Cohere's optional QK norms: LayerNorms with a weight per head and lane."""
    config_cls, model_cls, extra = ARCHITECTURES["cohere"]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**COMMON, **extra, "use_qk_norm": True})).eval()
    for module in model.modules():  # weights that start at one: make them matter
        if type(module).__name__ == "CohereLayerNorm":
            torch.nn.init.normal_(module.weight, mean=1.0, std=0.3)
    llm = LLM(loaded=loaded(model), max_num_batched_tokens=24)
    assert llm.engine.runner.body.layers[0].attention.norms.per_head
    _run_both(llm, random_prompts([5, 30, 17], seed=6))


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_projections_apart_as_under_tensor_parallelism(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tensor parallelism shards q/k/v and gate/up apart, and fusion leaves them so."""
    monkeypatch.setattr(model_prep, "fuse_projections", lambda model: 0)
    llm = LLM(loaded=loaded(tiny_model(family)), max_num_batched_tokens=24)
    runner = llm.engine.runner
    first = runner.body.layers[0]
    assert first.attention.qkv is None and first.feed_forward.gate_up is None
    _run_both(llm, random_prompts([5, 30, 17], seed=2))


def test_int4_weights() -> None:
    model = tiny_model("llama").to(torch.bfloat16)
    llm = LLM(loaded=loaded(model), quantization="int4", max_num_batched_tokens=24)
    _run_both(llm, random_prompts([9, 40], seed=3))


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_sliding_window(family: str) -> None:
    """Mistral passes its config's window to every layer, Qwen2 a window per layer; both reach
    the paged attention, which cuts 30-token contexts at 8."""
    model = tiny_model(family)
    if family == "mistral":
        model.config.sliding_window = 8
    else:
        for layer in model.model.layers:
            layer.self_attn.sliding_window = 8
    llm = LLM(loaded=loaded(model), max_num_batched_tokens=24)
    assert [layer.attention.sliding_window for layer in llm.engine.runner.body.layers] == [8, 8]
    prompts = random_prompts([30, 12], seed=4)
    _run_both(llm, prompts)
    if family != "mistral":
        return  # HF masks Qwen2's window only where config.layer_types asks for it
    # and the window is applied: HF's own generate with the same window, token for token
    fresh = LLM(loaded=loaded(model))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    got = [r.token_ids for r in fresh.generate(prompts, params)]
    model.config._attn_implementation = "sdpa"
    assert got == [hf_greedy(model, p, 6) for p in prompts]


def test_llama_has_no_window() -> None:
    llm = LLM(loaded=loaded(tiny_model("llama")))
    assert {layer.attention.sliding_window for layer in llm.engine.runner.body.layers} == {None}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 576), (7, 64), (300, 896), (24, 3, 128)])
def test_rms_norm_gives_hf_norms_bits(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """``RMSNorm`` computes with fewer ops than HF's ``LlamaRMSNorm`` (the class every family's
    norm copies) on the CPU, and with HF's ops elsewhere; both must give HF's bits, on rows and
    on per-head ``[T, H, D]`` (Qwen3)."""
    width = shape[-1]
    hf = LlamaRMSNorm(width, eps=1e-6).to(dtype)
    generator = torch.Generator().manual_seed(width)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.3 * torch.randn(width, generator=generator))
    for scale in (1e-3, 1.0, 50.0):
        x = (scale * torch.randn(shape, generator=generator)).to(dtype)
        with torch.no_grad():
            expected = hf(x)
            assert torch.equal(RMSNorm.of(hf, fused=True)(x), expected)  # the CPU's
            assert torch.equal(RMSNorm.of(hf, fused=False)(x), expected)  # off the CPU
