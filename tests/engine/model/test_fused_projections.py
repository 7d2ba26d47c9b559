"""Fused q/k/v and gate/up projections: the same numbers as the separate modules, bit for bit,
in any call order, and the engine's greedy tokens still equal Hugging Face for every family."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from paged_serve.engine.llm import LLM
from paged_serve.engine.model.fused_projections import (
    FusedLinear,
    FusedPart,
    fuse_projections,
    unfuse_projections,
)
from paged_serve.engine.sampling_params import SamplingParams
from tests.conftest import TINY_FAMILIES, hf_greedy, loaded, tiny_model


def _linears(bias: bool) -> list[nn.Linear]:
    torch.manual_seed(0)
    return [nn.Linear(96, n, bias=bias) for n in (64, 32, 32)]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1), (1, 1, 0, 2)])
def test_parts_equal_the_separate_projections_in_any_order(bias: bool, order: tuple) -> None:
    linears = _linears(bias)
    fused = FusedLinear(linears)
    parts = [FusedPart(fused, i) for i in range(3)]
    for rows in (1, 7, 40):
        x = torch.randn(1, rows, 96)
        for i in order:
            assert torch.equal(parts[i](x), linears[i](x))


def test_a_new_input_is_never_served_the_previous_inputs_parts() -> None:
    linears = _linears(False)
    fused = FusedLinear(linears)
    q, k = FusedPart(fused, 0), FusedPart(fused, 1)
    a, b = torch.randn(3, 96), torch.randn(3, 96)
    q(a)  # leaves a's k and v waiting
    assert torch.equal(k(b), linears[1](b))
    assert torch.equal(k(a), linears[1](a))


def test_fused_linear_refuses_mixed_bias_and_input_sizes() -> None:
    with pytest.raises(ValueError, match="bias"):
        FusedLinear([nn.Linear(8, 4), nn.Linear(8, 4, bias=False)])
    with pytest.raises(ValueError, match="one size"):
        FusedLinear([nn.Linear(8, 4), nn.Linear(6, 4)])


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_fusion_replaces_every_group_and_keeps_the_logits(family: str) -> None:
    model = tiny_model(family)
    fused = copy.deepcopy(model)
    assert fuse_projections(fused) == 2 * model.config.num_hidden_layers
    assert fuse_projections(fused) == 0  # already fused: nothing left to do
    layer = fused.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, FusedLinear)
    assert isinstance(layer.mlp.gate_up_proj, FusedLinear)
    # one copy of the weights: the parts own none
    assert sum(p.numel() for p in fused.parameters()) == sum(p.numel() for p in model.parameters())
    ids = torch.tensor([[3, 17, 92, 5, 44, 8]])
    with torch.inference_mode():
        assert torch.equal(fused(ids).logits, model(ids).logits)


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_engine_with_fused_projections_equals_hf_greedy(family: str) -> None:
    model = tiny_model(family)
    prompts = [[5, 9, 33, 70, 2], list(range(10, 41))]
    llm = LLM(loaded=loaded(model), kv_cache_memory=2 << 20, max_num_batched_tokens=16)
    assert isinstance(llm.engine.runner.model.model.layers[0].self_attn.qkv_proj, FusedLinear)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(model, prompt, 12)


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # without and with q/k/v biases
def test_unfuse_gives_back_the_original_modules(family: str) -> None:
    model = tiny_model(family)
    fused = copy.deepcopy(model)
    fuse_projections(fused)
    assert unfuse_projections(fused) == 2 * model.config.num_hidden_layers
    assert unfuse_projections(fused) == 0
    want = dict(model.named_parameters())
    got = dict(fused.named_parameters())
    assert got.keys() == want.keys()
    assert all(torch.equal(got[name], want[name]) for name in want)
    assert all(type(m) is not FusedPart for m in fused.modules())
