"""Weight-only int8 under tensor parallelism: every rank quantizes its own shards after
sharding, and a TP=2 int8 engine's greedy tokens equal Hugging Face on the weights it multiplies
by. (Its own module: the TP engines of tests/test_tensor_parallel.py hold the process group
until that module ends.)"""

from __future__ import annotations

import copy

import torch
from torch import nn

from engine import LLM, SamplingParams
from engine.fused_projections import fuse_projections
from engine.int8_weights import Int8Linear, quantize_int8
from tests.conftest import assert_pool_clean, hf_greedy, loaded, random_prompts, tiny_model

MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


class _SumOfHalves(nn.Module):
    """What a row-parallel int8 projection computes at TP=2: each rank's int8 product of its
    half of the input, summed (a sum of two terms: the all-reduce's order cannot matter)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.halves = nn.ModuleList()
        for half in linear.weight.detach().chunk(2, dim=1):
            part = nn.Linear(half.shape[1], half.shape[0], bias=False)
            part.weight.data = half.clone()
            self.halves.append(Int8Linear(part))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, dim=-1)
        y = self.halves[0](a) + self.halves[1](b)
        return y if self.bias is None else y + self.bias


def _int8_twin_at_tp2(model: nn.Module) -> nn.Module:
    """``model`` computing what a TP=2 int8 engine computes, under HF's own attention: int8
    column-parallel projections equal the unsharded int8 ones (one scale per output row either
    way); each row-parallel one is the sum of its two ranks' halves."""
    twin = copy.deepcopy(model)
    for layer in twin.model.layers:
        layer.self_attn.o_proj = _SumOfHalves(layer.self_attn.o_proj)
        layer.mlp.down_proj = _SumOfHalves(layer.mlp.down_proj)
    fuse_projections(twin)
    quantize_int8(twin, torch.device("cpu"))
    return twin


def test_int8_at_tp2_quantizes_every_rank_shard_and_equals_hf_on_those_weights():
    """Each rank quantizes its own shards after sharding, the row-parallel ones included, so a
    row-parallel row gets one scale per rank's half (at least as fine as TP=1's one per row):
    the tokens equal HF generate on a twin that computes exactly that."""
    model = tiny_model("llama")
    prompts = random_prompts([5, 17, 40], seed=3)
    tp2 = LLM(loaded=loaded(model), tensor_parallel_size=2, kv_cache_memory=2 << 20,
              quantization="int8")  # fmt: skip
    try:
        layer = tp2.engine.runner.model.model.layers[0]
        assert isinstance(layer.mlp.down_proj.proj, Int8Linear)
        assert isinstance(layer.self_attn.qkv_proj.proj, Int8Linear)
        twin = _int8_twin_at_tp2(model)
        got = [r.token_ids for r in tp2.generate(prompts, GREEDY)]
        assert got == [hf_greedy(twin, p, MAX_TOKENS) for p in prompts]
        assert_pool_clean(tp2.engine.block_manager)
    finally:
        tp2.shutdown()
