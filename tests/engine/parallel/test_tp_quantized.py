"""Weight-only int8 and int4 under tensor parallelism: every rank quantizes its own shards after
sharding, and a TP=2 quantized engine's greedy tokens equal Hugging Face on the weights it
multiplies by. (Its own module: the TP engines of tests/engine/parallel/test_tensor_parallel.py hold
the process group until that module ends.)"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from paged_serve.engine import LLM, SamplingParams
from paged_serve.engine.model.fused_projections import fuse_projections
from paged_serve.engine.model.int4_weights import Int4Linear, quantize_int4
from paged_serve.engine.model.int8_weights import Int8Linear, quantize_int8
from paged_serve.engine.platform.platform import platform_for
from tests.conftest import assert_pool_clean, hf_greedy, loaded, random_prompts, tiny_model

MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
SCHEMES = {"int8": (Int8Linear, quantize_int8), "int4": (Int4Linear, quantize_int4)}


class _SumOfHalves(nn.Module):
    """What a row-parallel quantized projection computes at TP=2: each rank's quantized product
    of its half of the input, summed (a sum of two terms: the all-reduce's order cannot
    matter)."""

    def __init__(self, linear: nn.Linear, quantized: type[nn.Module]):
        super().__init__()
        self.halves = nn.ModuleList()
        for half in linear.weight.detach().chunk(2, dim=1):
            part = nn.Linear(half.shape[1], half.shape[0], bias=False)
            part.weight.data = half.clone()
            self.halves.append(quantized(part))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, dim=-1)
        y = self.halves[0](a) + self.halves[1](b)
        return y if self.bias is None else y + self.bias


def _twin_at_tp2(model: nn.Module, scheme: str) -> nn.Module:
    """``model`` computing what a TP=2 quantized engine computes, under HF's own attention:
    column-parallel projections equal the unsharded quantized ones (int8's scales are per
    output row, int4's per output row and group of inputs); each row-parallel one is the sum of
    its two ranks' halves."""
    quantized, quantize = SCHEMES[scheme]
    twin = copy.deepcopy(model)
    for layer in twin.model.layers:
        layer.self_attn.o_proj = _SumOfHalves(layer.self_attn.o_proj, quantized)
        layer.mlp.down_proj = _SumOfHalves(layer.mlp.down_proj, quantized)
    fuse_projections(twin)
    quantize(twin, platform_for(torch.device("cpu")))
    return twin


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_tp2_quantizes_every_rank_shard_and_equals_hf_on_those_weights(scheme: str):
    """Each rank quantizes its own shards after sharding, the row-parallel ones included (an
    int8 row gets one scale per rank's half, at least as fine as TP=1's one per row): the tokens
    of each prompt alone equal HF generate on a twin that computes exactly that. (Alone: int4
    picks its kernel by the step's row count, as HF's prefill of one prompt does.) Attention
    runs torch's SDPA, as HF's does (see test_int4_weights.py)."""
    quantized, _ = SCHEMES[scheme]
    model = tiny_model("llama")
    prompts = random_prompts([5, 17, 40], seed=3)
    tp2 = LLM(loaded=loaded(model), tensor_parallel_size=2, kv_cache_memory=2 << 20,
              quantization=scheme, cpu_decode_kernel=False)  # fmt: skip
    try:
        layer = tp2.engine.runner.model.model.layers[0]
        assert isinstance(layer.mlp.down_proj.proj, quantized)
        assert isinstance(layer.self_attn.qkv_proj.proj, quantized)
        twin = _twin_at_tp2(model, scheme)
        got = [tp2.generate([p], GREEDY)[0].token_ids for p in prompts]
        assert got == [hf_greedy(twin, p, MAX_TOKENS) for p in prompts]
        assert_pool_clean(tp2.engine.block_manager)
    finally:
        tp2.shutdown()
