"""A checkpoint's quantized projections on the CPU (``engine/quant/``): which kernel each gets.

* 4-bit packed integers (GPTQ, AWQ, compressed-tensors W4A16) stay packed: the model holds
  the 4-bit codes and their group scales (and zeros), never a full-precision copy, and a product
  dequantizes them as it multiplies (``QuantizedLinear``'s torch path: the weight dequantized
  for the call, then ``F.linear``; exact in the model's dtype).
* 8-bit integers and FP8 (GPTQ 8-bit, W8A16, W8A8 int8, FP8 W8A8) are dequantized once, at
  load, into the model's dtype and multiplied as any projection (the fp32 and bf16 kernels of
  ``engine/platform/cpu/linears.py``): the CPU has no FP8 arithmetic, and torch's int8 kernel
  reads one scale per output row and rounds activations to bf16, so the tokens would no longer
  be those of the checkpoint's dequantized weights. The memory is the model dtype's.

The start-up log says which kernel each kind got and why.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn

from paged_serve.engine.model.fused_projections import linear_from
from paged_serve.engine.quant.linear import QuantizedLinear
from paged_serve.engine.quant.weights import PackedInt

logger = logging.getLogger(__name__)


def _kept_packed(module: QuantizedLinear) -> bool:
    stored = module.stored
    return isinstance(stored, PackedInt) and stored.bits == 4


@torch.no_grad()
def place_quantized_linears(model: nn.Module, dtype: torch.dtype) -> Counter:
    """In place: each ``QuantizedLinear`` of ``model`` kept packed (4-bit) or replaced by a plain
    ``nn.Linear`` of its dequantized weight in ``dtype``; returns how many of each, logged."""
    placed: Counter = Counter()
    for owner in list(model.modules()):
        for name, child in list(owner.named_children()):
            if not isinstance(child, QuantizedLinear):
                continue
            if _kept_packed(child):
                placed["4-bit kept packed, dequantized per product"] += 1
                continue
            weight = child.stored.dequantize().to(dtype)
            bias = None if child.bias is None else child.bias.detach().to(dtype)
            setattr(owner, name, linear_from(weight, bias))
            placed[f"{child.layout} dequantized to {dtype} at load (no CPU kernel reads it)"] += 1
    for kind, count in sorted(placed.items()):
        logger.info("quantized projections on the CPU: %d %s", count, kind)
    return placed
