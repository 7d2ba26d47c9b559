"""Weight-only int4: the codes stay within half a step of the weights, a Q4_1 weight comes back
exactly, both kernels multiply by the same dequantized weights, and the engine's greedy tokens
equal Hugging Face ``generate`` on a twin with the same int4 modules (so paged attention, fusion
and the scheduler add nothing to the quantization's own approximation)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from paged_serve.engine.config import EngineConfig
from paged_serve.engine.llm import LLM
from paged_serve.engine.model.int4_weights import (
    GROUP_SIZE,
    MAX_KERNEL_ROWS,
    Int4Experts,
    Int4Linear,
    dequantize,
    quantize_groups,
    quantize_int4,
)
from paged_serve.engine.model.packed_weights import packable
from paged_serve.engine.platform.cpu.linears import PackedLinear
from paged_serve.engine.platform.platform import platform_for
from paged_serve.engine.sampling_params import SamplingParams
from tests.conftest import (
    QUANTIZED_EXPERTS_REFERENCE,
    TINY_FAMILIES,
    assert_pool_clean,
    hf_greedy,
    loaded,
    quantized_twin,
    tiny_model,
)
from tests.engine.model.test_model_coverage import tiny_architecture

CPU = torch.device("cpu")


def _linear(out_features: int, in_features: int, bias: bool = False) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(in_features, out_features, bias=bias)


def test_codes_are_within_half_a_step_and_span_each_group() -> None:
    weight = _linear(48, 160).weight
    codes, scale, offset = quantize_groups(weight)
    assert codes.dtype == torch.int32 and int(codes.min()) == 0 and int(codes.max()) == 15
    step = scale.float().repeat_interleave(GROUP_SIZE, dim=1)
    assert ((dequantize(codes, scale, offset) - weight).abs() <= step / 2 + 1e-6).all()
    per_group = codes.view(48, -1, GROUP_SIZE)
    assert (per_group.amin(-1) == 0).all() and (per_group.amax(-1) == 15).all()


def test_a_q4_1_weight_comes_back_exactly() -> None:
    """Weights already of the form code * d + m per group of 32 (llama.cpp's Q4_1), with d and
    the offset representable in bf16, are recovered bit for bit."""
    torch.manual_seed(1)
    n, k = 32, 128
    codes = torch.randint(0, 16, (n, k // GROUP_SIZE, GROUP_SIZE))
    codes[..., 0], codes[..., 1] = 0, 15  # every group uses the whole range
    d = 2.0 ** -torch.randint(3, 9, (n, k // GROUP_SIZE, 1)).float()
    m = torch.randint(-24, 8, (n, k // GROUP_SIZE, 1)).float() * d
    weight = (codes * d + m).view(n, k)
    assert torch.equal(dequantize(*quantize_groups(weight)), weight)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, MAX_KERNEL_ROWS, MAX_KERNEL_ROWS + 1, 40])
def test_int4_linear_multiplies_by_its_dequantized_weight(rows: int, bias: bool) -> None:
    """Up to MAX_KERNEL_ROWS rows run torch's int4 kernel, more the bf16 GEMM: each equals the
    product of the bf16-rounded input and the dequantized weight, up to the bf16 output's
    rounding (and the bf16 copy's, on the GEMM)."""
    linear = _linear(64, 96, bias=bias)
    q = Int4Linear(linear)
    weight = dequantize(*quantize_groups(linear.weight))
    x = torch.randn(rows, 96)
    y = q(x)
    assert y.dtype == x.dtype and y.shape == (rows, 64)
    expected = x.bfloat16().float() @ weight.T
    got = y - (0 if linear.bias is None else linear.bias)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2**-7)


def test_the_int4_kernel_gives_a_row_the_same_bits_in_any_batch() -> None:
    q = Int4Linear(_linear(64, 128))
    x = torch.randn(MAX_KERNEL_ROWS, 128, dtype=torch.bfloat16)
    alone = torch.cat([q(x[i : i + 1]) for i in range(MAX_KERNEL_ROWS)])
    assert torch.equal(q(x), alone)


@pytest.mark.parametrize("rows", [1, MAX_KERNEL_ROWS])
def test_a_decode_rows_shortcut_gives_what_every_input_form_gets(rows: int) -> None:
    """Contiguous bf16 rows go straight to the kernel; fp32, strided and 3-D inputs of the same
    values take the general path, and all give the same bits."""
    q = Int4Linear(_linear(64, 96))
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    direct = q(x)
    assert direct.dtype == torch.bfloat16 and direct.shape == (rows, 64)
    strided = torch.randn(rows, 192, dtype=torch.bfloat16)[:, ::2]
    strided.copy_(x)
    assert not strided.is_contiguous()
    assert torch.equal(q(strided), direct)
    assert torch.equal(q(x[None])[0], direct)
    assert torch.equal(q(x.float()), direct.float())


def test_int4_linear_deep_copies_and_pickles() -> None:
    q = Int4Linear(_linear(64, 128, bias=True))
    x = torch.randn(MAX_KERNEL_ROWS + 3, 128)
    for twin in (copy.deepcopy(q), pickle.loads(pickle.dumps(q))):
        assert torch.equal(twin(x), q(x)) and torch.equal(twin(x[:1]), q(x[:1]))


def test_int4_refuses_shapes_its_kernel_cannot_take_and_quantize_skips_them() -> None:
    with pytest.raises(ValueError, match="in_features % 32"):
        Int4Linear(_linear(64, 48))
    with pytest.raises(ValueError, match="out_features % 16"):
        Int4Linear(_linear(40, 64))
    model = tiny_model("llama")
    model.model.layers[0].mlp.down_proj = _linear(128, 250)  # misfit: 250 inputs
    model.model.layers[0].mlp.up_proj = _linear(250, 128)
    model.model.layers[0].mlp.gate_proj = _linear(250, 128)
    swapped = quantize_int4(model, platform_for(CPU))
    assert swapped == 2 * 7 - 3
    assert type(model.model.layers[0].mlp.down_proj) is nn.Linear
    assert isinstance(model.model.layers[1].mlp.down_proj, Int4Linear)


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_engine_int4_equals_hf_with_the_same_int4_modules(family: str) -> None:
    """Each prompt alone, as HF runs it: a short one whose prefill runs the int4 kernel and a
    long one whose prefill runs the bf16 GEMM; decoding runs the kernel. (Batched, a prompt's
    prefill may share a GEMM step with another's, so which kernel runs depends on the batch.)
    The LM head stays an unquantized projection. Attention runs torch's SDPA, as HF's does:
    the int4 projections round their inputs to bf16, which turns the C decode kernel's fp32
    rounding differences into different tokens within a dozen steps (tests/
    test_cpu_decode_attention.py tests that kernel against the reference)."""
    model = tiny_model(family)
    llm = LLM(loaded=loaded(model), kv_cache_memory=2 << 20, quantization="int4",
              cpu_decode_kernel=False)  # fmt: skip
    runner_model = llm.engine.runner.model
    layer = runner_model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj.proj, Int4Linear)
    assert isinstance(layer.mlp.gate_up_proj.proj, Int4Linear)
    assert isinstance(layer.mlp.down_proj, Int4Linear)
    assert not isinstance(runner_model.lm_head, Int4Linear)
    reference = quantized_twin(model, quantize_int4)
    prompts = [[5, 9, 33, 70, 2], list(range(10, 41))]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for prompt in prompts:
        assert llm.generate([prompt], greedy)[0].token_ids == hf_greedy(reference, prompt, 12)
    assert_pool_clean(llm.engine.block_manager)


def test_a_bf16_model_keeps_its_lm_head_in_bf16_packed_where_the_cpu_packs_bf16() -> None:
    llm = LLM(loaded=loaded(tiny_model("qwen3").bfloat16()), kv_cache_memory=2 << 20,
              quantization="int4")  # fmt: skip
    head = llm.engine.runner.model.lm_head
    if packable(torch.bfloat16):
        assert isinstance(head, PackedLinear)
    else:  # an AVX2-only CPU: F.linear on the bf16 weight
        assert type(head) is nn.Linear and head.weight.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "dtype,quantization,grouped",
    [
        (torch.bfloat16, "int4", True),  # not HF's weights: the fast layout
        (torch.bfloat16, None, False),  # HF's own bf16 tokens alone
        (torch.float32, "int4", False),  # both layouts cost the same: keep HF's rounding
    ],
)
def test_a_lone_decode_row_is_grouped_only_for_quantized_bf16(
    dtype: torch.dtype, quantization: str | None, grouped: bool
) -> None:
    model = tiny_model("llama").to(dtype)
    llm = LLM(loaded=loaded(model), kv_cache_memory=2 << 20, quantization=quantization)
    assert llm.engine.runner.backend.paged_attention.__self__.group_alone is grouped


def test_int4_is_refused_off_the_cpu_and_accepted_by_the_config() -> None:
    with pytest.raises(ValueError, match="runs on the CPU"):
        quantize_int4(tiny_model("llama"), platform_for(torch.device("cuda")))
    assert EngineConfig(quantization="int4").quantization == "int4"


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_engine_int4_experts_equal_hf_with_the_same_int4_experts(name: str) -> None:
    """Mixture-of-experts layers quantize each expert to int4 (an ``Int4Linear`` each): the
    engine's tokens equal HF's forward on a twin whose experts multiply through the same ones."""
    model = tiny_architecture(name)
    llm = LLM(loaded=loaded(model), kv_cache_memory=2 << 20, quantization="int4",
              cpu_decode_kernel=False)  # fmt: skip
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    assert isinstance(experts.gate_up_proj, Int4Experts)
    assert isinstance(experts.down_proj, Int4Experts)
    reference = quantized_twin(model, quantize_int4)
    reference.set_experts_implementation(QUANTIZED_EXPERTS_REFERENCE)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for prompt in [[5, 9, 33, 70, 2], list(range(10, 41))]:
        assert llm.generate([prompt], greedy)[0].token_ids == hf_greedy(reference, prompt, 12)
    assert_pool_clean(llm.engine.block_manager)
