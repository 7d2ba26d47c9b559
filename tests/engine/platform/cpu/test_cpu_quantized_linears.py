"""A checkpoint's packed 4- and 8-bit projections on the CPU: ``place_quantized_linears`` puts the
C integer GEMM in place (act-order inputs gathered, fp32 and bf16 models), says so in the log,
falls back to torch's exact path where the kernel cannot load, and the engine's greedy tokens on
a tiny Llama whose projections are packed equal Hugging Face's over the dequantized weights."""

from __future__ import annotations

import copy
import logging
import pickle

import pytest
import torch
from torch import nn

from paged_serve.engine.llm import LLM
from paged_serve.engine.platform.cpu import quantized_linears
from paged_serve.engine.platform.cpu.quantized_linears import (
    IntGemmLinear,
    place_quantized_linears,
)
from paged_serve.engine.quant.linear import QuantizedLinear
from paged_serve.engine.quant.weights import PackedInt, packed_int
from paged_serve.engine.sampling_params import SamplingParams
from tests.conftest import assert_pool_clean, hf_greedy, loaded, tiny_model


def _packed(n: int, k: int, *, bits: int, group_size: int, zeros: bool, act_order: bool,
            seed: int) -> PackedInt:  # fmt: skip
    """Random codes whose weights have about the tiny models' spread (std ~0.1); act-order's
    permutation depends on ``k`` alone, so projections of one input share it (and fuse)."""
    gen = torch.Generator().manual_seed(seed)
    groups = 1 if group_size == -1 else k // group_size
    codes = torch.randint(0, 1 << bits, (k, n), generator=gen)
    step = 0.3 / (1 << bits)  # codes span about +-0.15
    scales = step * (0.5 + torch.rand(groups, n, generator=gen))
    zero = None
    if zeros:
        middle = 1 << (bits - 1)
        zero = torch.randint(middle - 2, middle + 3, (groups, n), generator=gen)
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(k)) if act_order else None
    return packed_int(codes, scales, zero, bits=bits, group_size=group_size, perm=perm)


def _module(n: int, k: int, bias: bool = False, **layout) -> QuantizedLinear:
    return QuantizedLinear(_packed(n, k, **layout), torch.randn(n) if bias else None)


class _Holder(nn.Module):
    def __init__(self, **children: nn.Module):
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)


LAYOUTS = {
    "4bit-g32-zeros-actorder": dict(bits=4, group_size=32, zeros=True, act_order=True),
    "4bit-g128-sym": dict(bits=4, group_size=128, zeros=False, act_order=False),
    "8bit-one-group-sym": dict(bits=8, group_size=-1, zeros=False, act_order=False),
    "8bit-g64-zeros-actorder": dict(bits=8, group_size=64, zeros=True, act_order=True),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_packed_projections_get_the_c_kernel_and_multiply_by_their_dequantized_weight(
    layout: str, dtype: torch.dtype, caplog: pytest.LogCaptureFixture
) -> None:
    original = _module(40, 256, bias=True, seed=1, **LAYOUTS[layout])
    holder = _Holder(proj=copy.deepcopy(original))
    with caplog.at_level(logging.INFO, logger=quantized_linears.__name__):
        placed = place_quantized_linears(holder, dtype)
    bits = LAYOUTS[layout]["bits"]
    assert isinstance(holder.proj, IntGemmLinear)
    assert placed == {f"{bits}-bit kept packed, on the C kernel int_gemm.c (reads the codes)": 1}
    assert "int_gemm.c" in caplog.text
    weight = original.stored.dequantize().double()
    for rows in (1, 5, 16):
        x = torch.randn(2, rows, 256).to(dtype)
        y = holder.proj(x)
        assert y.dtype == dtype and y.shape == (2, rows, 40)
        expected = x.double() @ weight.t() + original.bias.double()
        if dtype == torch.float32:
            torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)
        else:  # the fp32 result rounded once to bf16
            torch.testing.assert_close(y.double(), expected, rtol=2**-8, atol=1e-5)


def test_it_deep_copies_and_pickles() -> None:
    holder = _Holder(proj=_module(24, 128, seed=2, **LAYOUTS["4bit-g32-zeros-actorder"]))
    place_quantized_linears(holder, torch.float32)
    x = torch.randn(3, 128)
    for twin in (copy.deepcopy(holder.proj), pickle.loads(pickle.dumps(holder.proj))):
        assert isinstance(twin, IntGemmLinear) and torch.equal(twin(x), holder.proj(x))


def test_without_the_kernel_4bit_stays_on_torchs_path_and_8bit_is_dequantized_at_load(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(quantized_linears.int_gemm, "load", lambda cache_dir: None)
    four = _module(24, 128, seed=3, **LAYOUTS["4bit-g32-zeros-actorder"])
    eight = _module(24, 128, bias=True, seed=4, **LAYOUTS["8bit-g64-zeros-actorder"])
    holder = _Holder(four=copy.deepcopy(four), eight=copy.deepcopy(eight))
    with caplog.at_level(logging.INFO, logger=quantized_linears.__name__):
        place_quantized_linears(holder, torch.float32)
    assert "no C kernel here" in caplog.text
    assert type(holder.four) is QuantizedLinear and holder.four.kernel == "torch"
    assert type(holder.eight) is nn.Linear
    x = torch.randn(3, 128)
    assert torch.equal(holder.four(x), four(x))  # the same torch path, untouched
    assert torch.equal(holder.eight.weight, eight.stored.dequantize())


@torch.no_grad()
def _packed_llama(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """(a tiny Llama whose projections are packed QuantizedLinear, HF's twin with their
    dequantized weights as fp32 nn.Linear). Layer 0: 4-bit, groups of 32 with zeros, act-order
    q/k/v; layer 1: 8-bit symmetric, one group (down_proj 4-bit, groups of 128)."""
    model = tiny_model("llama", seed=seed)
    reference = copy.deepcopy(model)
    for index, (layer, twin) in enumerate(
        zip(model.model.layers, reference.model.layers, strict=True)
    ):
        for block, names in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                             ("mlp", ("gate_proj", "up_proj", "down_proj"))):  # fmt: skip
            owner, twin_owner = getattr(layer, block), getattr(twin, block)
            for offset, name in enumerate(names):
                linear = getattr(owner, name)
                if index == 0:
                    layout = dict(bits=4, group_size=32, zeros=True, act_order=False)
                    if name in ("q_proj", "k_proj", "v_proj"):  # one perm, so they still fuse
                        layout["act_order"] = True
                elif name == "down_proj":
                    layout = dict(bits=4, group_size=128, zeros=False, act_order=False)
                else:
                    layout = dict(bits=8, group_size=-1, zeros=False, act_order=False)
                module = _module(
                    linear.out_features, linear.in_features, seed=10 * index + offset, **layout
                )
                setattr(owner, name, module)
                getattr(twin_owner, name).weight.copy_(module.stored.dequantize())
    return model, reference


@torch.no_grad()
def test_engine_greedy_equals_hf_over_the_dequantized_weights() -> None:
    model, reference = _packed_llama()
    llm = LLM(loaded=loaded(model), kv_cache_memory=2 << 20)
    layers = llm.engine.runner.model.model.layers
    assert isinstance(layers[0].self_attn.qkv_proj.proj, IntGemmLinear)
    assert layers[0].self_attn.qkv_proj.proj.perm is not None
    assert isinstance(layers[0].mlp.gate_up_proj.proj, IntGemmLinear)
    assert isinstance(layers[1].mlp.down_proj, IntGemmLinear)
    assert layers[1].self_attn.o_proj.bits == 8
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 33, 70, 2], list(range(10, 41))]
    for prompt in prompts:
        assert llm.generate([prompt], greedy)[0].token_ids == hf_greedy(reference, prompt, 12)
    assert_pool_clean(llm.engine.block_manager)
