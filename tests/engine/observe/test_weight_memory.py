"""weight_memory: every parameter, buffer and oneDNN-packed weight counted once."""

from __future__ import annotations

import torch
from torch import nn

from paged_serve.engine.model.packed_weights import packable
from paged_serve.engine.observe.weight_memory import MIB, WeightMemory, weight_memory
from paged_serve.engine.platform.cpu.linears import PackedLinear


def test_tied_weights_and_views_count_once() -> None:
    model = nn.Sequential(nn.Embedding(100, 16), nn.Linear(16, 100, bias=False))
    model[1].weight = model[0].weight  # tied, as an LM head
    model.register_buffer("first_rows", model[0].weight.detach()[:50])  # a view of the same storage
    model.register_buffer("scale", torch.ones(8))
    got = weight_memory(model, torch.float32, "gptq (W4A16 g32)")
    assert got == WeightMemory(100 * 16 * 4 + 8 * 4, "float32", "gptq (W4A16 g32)")


def test_packed_weights_are_counted() -> None:
    linear = nn.Linear(64, 32)
    model = nn.Sequential(PackedLinear(linear))
    got = weight_memory(model, torch.float32)
    packed = 32 * 64 * 4 if packable(torch.float32) else 0  # the plain weight is then kept
    assert got.bytes >= 32 * 4 + max(packed, 32 * 64 * 4)
    assert got.quantization is None


def test_describe_names_the_storage() -> None:
    assert WeightMemory(3 * MIB, "bfloat16", None).describe() == (
        "weights: 3.0 MiB in memory (bfloat16)"
    )
    assert (
        "stored gptq (W4A16 g128)" in WeightMemory(MIB, "float32", "gptq (W4A16 g128)").describe()
    )
