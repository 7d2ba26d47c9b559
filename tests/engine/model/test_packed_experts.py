"""Experts packed for oneDNN on the CPU (engine/platform/cpu/packed_experts.py): each expert's
product is ``F.linear``'s (within fp32's rounding bound), copies and pickles
carry the weights, sharding gets plain Parameters back, and the engine's greedy tokens equal
Hugging Face's for mixture-of-experts families in either experts layout."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

from paged_serve.engine.llm import LLM
from paged_serve.engine.model.experts_swap import experts_modules
from paged_serve.engine.platform.cpu.packed_experts import (
    PackedExperts,
    pack_experts,
    restore_plain_experts,
)
from paged_serve.engine.sampling_params import SamplingParams
from tests.conftest import assert_pool_clean, hf_greedy, loaded
from tests.engine.model.test_model_coverage import tiny_architecture


def test_each_expert_is_f_linear_to_fp32_rounding() -> None:
    torch.manual_seed(0)
    weight = torch.randn(4, 40, 96)  # [E, out, in]
    packed = PackedExperts(weight)
    assert packed.shape == (4, 40, 96)
    assert torch.equal(packed.dense(), weight)
    bias = torch.randn(40)
    for rows in (1, 3, 8, 33):
        x = torch.randn(rows, 96)
        for expert in range(4):
            truth = F.linear(x.double(), weight[expert].double(), bias.double())
            magnitude = F.linear(
                x.double().abs(), weight[expert].double().abs(), bias.abs().double()
            )
            bound = 97 * 2.0**-24 * (magnitude + truth.abs())
            assert ((packed.linear(x, expert, bias).double() - truth).abs() <= bound).all()
    strided = x.t().contiguous().t()  # the same rows, not contiguous
    assert torch.equal(packed.linear(strided, 0), packed.linear(x, 0))


def test_only_plain_fp32_cpu_experts_are_packed() -> None:
    model = tiny_architecture("qwen3_moe").to(torch.bfloat16)
    assert pack_experts(model) == 0


def test_copies_and_pickles_carry_the_packed_weights() -> None:
    torch.manual_seed(0)
    packed = PackedExperts(torch.randn(3, 16, 32))
    x = torch.randn(2, 32)
    for twin in (copy.deepcopy(packed), pickle.loads(pickle.dumps(packed))):
        assert torch.equal(twin.dense(), packed.dense())
        assert all(torch.equal(twin.linear(x, e), packed.linear(x, e)) for e in range(3))


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_restore_gives_sharding_the_plain_weights_back(name: str) -> None:
    """gpt-oss stores its experts ``[E, in, out]``: packed and restored they are ``[E, out, in]``
    with ``is_transposed`` cleared, the layout HF's forward then reads."""
    model = tiny_architecture(name)
    reference = copy.deepcopy(model)
    assert pack_experts(model) == len(experts_modules(model)) > 0
    assert restore_plain_experts(model) == len(experts_modules(model))
    for got, want in zip(experts_modules(model), experts_modules(reference)):
        assert isinstance(got.gate_up_proj, torch.nn.Parameter) and not got.is_transposed
        expected = want.gate_up_proj.transpose(1, 2) if want.is_transposed else want.gate_up_proj
        assert torch.equal(got.gate_up_proj, expected)
    ids = torch.tensor([[3, 17, 92, 5]])
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits)


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_engine_with_packed_experts_equals_hf_greedy(name: str) -> None:
    model = tiny_architecture(name)
    llm = LLM(loaded=loaded(model), kv_cache_memory=2 << 20, cpu_decode_kernel=False)
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    assert isinstance(experts.gate_up_proj, PackedExperts)
    assert isinstance(experts.down_proj, PackedExperts)
    prompts = [[5, 9, 33, 70, 2], list(range(10, 41))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(model, prompt, 10)
    assert_pool_clean(llm.engine.scheduler.block_manager)
