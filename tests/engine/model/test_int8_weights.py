"""Weight-only int8: the module multiplies (bf16 activations) by exactly the weights it says it
holds, the rounding stays within half a step, and the engine's greedy tokens equal Hugging Face
``generate`` on a twin with the same quantized modules (so paged attention, fusion and the
scheduler add nothing to the quantization's own approximation)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paged_serve.engine.config import EngineConfig
from paged_serve.engine.llm import LLM
from paged_serve.engine.model.int8_weights import Int8Experts, Int8Linear, quantize_int8
from paged_serve.engine.platform.platform import platform_for
from paged_serve.engine.sampling_params import SamplingParams
from tests.conftest import (
    QUANTIZED_EXPERTS_REFERENCE,
    TINY_FAMILIES,
    hf_greedy,
    loaded,
    quantized_twin,
    tiny_model,
)
from tests.engine.model.test_model_coverage import tiny_architecture

CPU = torch.device("cpu")


@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_multiplies_by_its_dequantized_weight(bias: bool) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 40, bias=bias)
    q = Int8Linear(linear)
    assert q.qweight.dtype == torch.int8 and q.qweight.abs().max() <= 127
    w = q.dequantized()
    # round to nearest: each weight is within half a step of its row's scale
    step = q.scale.float()[:, None]
    assert ((w - linear.weight).abs() <= step / 2 + 1e-7).all()
    x = torch.randn(2, 5, 96)
    y = q(x)
    assert y.dtype == x.dtype
    # the kernel takes bf16 activations and returns bf16: one rounding of each, no more
    expected = nn.functional.linear(x.bfloat16().float(), w)
    torch.testing.assert_close(y - (0 if linear.bias is None else linear.bias), expected,
                               atol=1e-3, rtol=2**-8)  # fmt: skip


def test_int8_linear_takes_bf16_activations() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 32, bias=False).bfloat16()
    q = Int8Linear(linear)
    x = torch.randn(7, 64, dtype=torch.bfloat16)
    y = q(x)
    assert y.dtype == torch.bfloat16
    expected = x.float() @ q.dequantized().T
    torch.testing.assert_close(y.float(), expected, atol=0.05, rtol=0.02)


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_engine_int8_equals_hf_with_the_same_int8_modules(family: str) -> None:
    """Attention runs torch's SDPA, as HF's does (see the int4 twin of this test)."""
    model = tiny_model(family)
    llm = LLM(loaded=loaded(model), kv_cache_memory=2 << 20, quantization="int8",
              cpu_decode_kernel=False)  # fmt: skip
    layer = llm.engine.runner.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj.proj, Int8Linear)
    assert isinstance(layer.mlp.down_proj, Int8Linear)
    assert isinstance(llm.engine.runner.model.lm_head, Int8Linear)
    reference = quantized_twin(model, quantize_int8)
    prompts = [[5, 9, 33, 70, 2], list(range(10, 41))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(reference, prompt, 12)


def test_int8_is_refused_off_the_cpu_and_unknown_schemes_are_refused() -> None:
    with pytest.raises(ValueError, match="runs on the CPU"):
        quantize_int8(tiny_model("llama"), platform_for(torch.device("cuda")))
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="nf4")


def test_int8_experts_multiply_each_expert_by_its_dequantized_weight() -> None:
    torch.manual_seed(0)
    weight = torch.randn(4, 40, 96)  # [E, out, in]
    q = Int8Experts(weight)
    assert q.qweight.dtype == torch.int8 and q.shape == (4, 40, 96)
    w = q.dequantized()
    assert ((w - weight).abs() <= q.scale.float()[..., None] / 2 + 1e-7).all()
    x, bias = torch.randn(5, 96), torch.randn(40)
    for expert in range(4):
        # as Int8Linear: bf16 activations in, one rounding of the product out, then the bias
        expected = nn.functional.linear(x.bfloat16().float(), w[expert])
        y = q.linear(x, expert)
        torch.testing.assert_close(y, expected, atol=1e-3, rtol=2**-8)
        assert torch.equal(q.linear(x, expert, bias), y + bias)


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_engine_int8_experts_equal_hf_with_the_same_int8_experts(name: str) -> None:
    """Mixture-of-experts layers quantize their experts too (gpt-oss's stored ``[E, in, out]``,
    with biases): the engine's tokens equal HF's forward on a twin whose experts multiply by
    the same int8 rows."""
    model = tiny_architecture(name)
    llm = LLM(loaded=loaded(model), kv_cache_memory=2 << 20, quantization="int8",
              cpu_decode_kernel=False)  # fmt: skip
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    assert isinstance(experts.gate_up_proj, Int8Experts)
    assert isinstance(experts.down_proj, Int8Experts)
    reference = quantized_twin(model, quantize_int8)
    reference.set_experts_implementation(QUANTIZED_EXPERTS_REFERENCE)
    prompts = [[5, 9, 33, 70, 2], list(range(10, 41))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(reference, prompt, 12)
