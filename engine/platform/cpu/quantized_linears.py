"""A checkpoint's quantized projections on the CPU (``engine/quant/``): which kernel each gets.

* 4- and 8-bit packed integers (GPTQ, AWQ, compressed-tensors W4A16/W8A16) stay packed and are
  multiplied by the C kernel of ``kernels/cpu/int_gemm.py`` (``IntGemmLinear``), which reads the
  codes in place: the model holds 4 or 8 bits a weight (plus group scales and zeros), never a
  full-precision copy, so 8-bit weights take half of bf16's memory and 4-bit a quarter. The
  weight is repacked once at load into the kernel's tiles (the original ``qweight`` is dropped);
  act-order inputs are gathered by ``perm`` first. Every row count runs the kernel, no
  threshold: measured on the 2-core CPU at a 1.5B model's MLP shapes (docs/measurements/
  cpu-kernels.md, "The 4- and 8-bit CPU product"), it stayed 1.4-10x faster from 16 to 256 rows
  than the best dequantizing path (the tiles dequantized to fp32 by a C loop written for the
  comparison, then ``F.linear``), since at many rows both are bound by the FMAs and dequantizing
  adds passes over an fp32 copy; torch's own dequantize is 10-100x slower still. Outputs equal
  the float64 product of the dequantized weight up to fp32 rounding, in fp32; a bf16 model's
  inputs are widened and its outputs rounded once.
* Where that kernel cannot be built (no C compiler), 4-bit weights stay packed and a product
  dequantizes them as it multiplies (``QuantizedLinear``'s torch path: exact, slow), and 8-bit
  weights are dequantized at load into the model's dtype (half the product's time of the torch
  path, twice the memory).
* FP8 and int8 W8A8 (``ScaledFp8``, ``ScaledInt8``) are dequantized once, at load, into the
  model's dtype and multiplied as any projection (the fp32 and bf16 kernels of
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

from paged_serve.engine.config import cache_root
from paged_serve.engine.model.fused_projections import linear_from
from paged_serve.engine.quant.linear import QuantizedLinear
from paged_serve.engine.quant.weights import PackedInt
from paged_serve.kernels.cpu import int_gemm
from paged_serve.kernels.cpu.int_gemm import CpuIntGemm, TiledInt

logger = logging.getLogger(__name__)


class IntGemmLinear(nn.Module):
    """``y = x @ W^T + bias`` for ``x [..., in_features]`` (fp32 or bf16, in x's dtype) with W a
    ``PackedInt`` in the C kernel's tiles (``kernels/cpu/int_gemm.py``).

    The tiles, scales, zeros and ``perm`` are non-persistent buffers (they move and count with
    the model); the loaded kernel is not copied or pickled, but found again."""

    TILED = ("tiles", "scales", "zeros")

    def __init__(self, weight: PackedInt, bias: torch.Tensor | None, kernel: CpuIntGemm):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        tiled = int_gemm.repack(
            weight.qweight,
            weight.scales,
            weight.zeros,
            bits=weight.bits,
            group_size=weight.group_size,
        )
        for name in self.TILED:
            self.register_buffer(name, getattr(tiled, name), persistent=False)
        self.register_buffer("perm", weight.perm, persistent=False)
        self.bits, self.group_size = tiled.bits, tiled.group_size
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._kernel = kernel

    @property
    def tiled(self) -> TiledInt:
        """The weight as ``TiledInt`` (views of the buffers)."""
        return TiledInt(
            tiles=self.tiles,
            scales=self.scales,
            zeros=self.zeros,
            bits=self.bits,
            group_size=self.group_size,
            out_features=self.out_features,
            in_features=self.in_features,
        )

    def __getstate__(self) -> dict[str, object]:
        return {k: v for k, v in self.__dict__.items() if k != "_kernel"}

    def __setstate__(self, state: dict[str, object]) -> None:
        super().__setstate__(state)
        self._kernel = int_gemm.load(cache_root())

    def extra_repr(self) -> str:
        return (
            f"{self.in_features} -> {self.out_features}, {self.bits}-bit, "
            f"group_size={self.group_size}, act_order={self.perm is not None}"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.perm is not None:  # act-order: row k of the weight is input perm[k]
            rows = rows.index_select(1, self.perm)
        y = self._kernel.matmul(rows, self.tiled, bias=self.bias)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


def _packed_bits(module: QuantizedLinear) -> int | None:
    stored = module.stored
    return stored.bits if isinstance(stored, PackedInt) else None


@torch.no_grad()
def place_quantized_linears(model: nn.Module, dtype: torch.dtype) -> Counter:
    """In place: each ``QuantizedLinear`` of ``model`` becomes an ``IntGemmLinear`` (packed
    integers, where the C kernel loads), stays packed on torch's path (4-bit without the
    kernel), or becomes a plain ``nn.Linear`` of its dequantized weight in ``dtype``; returns
    how many of each, logged."""
    kernel: CpuIntGemm | None = None
    if any(_packed_bits(m) is not None for m in model.modules() if isinstance(m, QuantizedLinear)):
        kernel = int_gemm.load(cache_root())  # logs why, where it cannot be built
    placed: Counter = Counter()
    for owner in list(model.modules()):
        for name, child in list(owner.named_children()):
            if not isinstance(child, QuantizedLinear):
                continue
            bits = _packed_bits(child)
            if bits is not None and kernel is not None:
                bias = None if child.bias is None else child.bias.detach()
                setattr(owner, name, IntGemmLinear(child.stored, bias, kernel))
                placed[f"{bits}-bit kept packed, on the C kernel int_gemm.c (reads the codes)"] += 1
                continue
            if bits == 4:
                placed["4-bit kept packed, dequantized per product (no C kernel here)"] += 1
                continue
            weight = child.stored.dequantize().to(dtype)
            bias = None if child.bias is None else child.bias.detach().to(dtype)
            setattr(owner, name, linear_from(weight, bias))
            why = "no C kernel here" if bits is not None else "no CPU kernel reads it"
            placed[f"{child.layout} dequantized to {dtype} at load ({why})"] += 1
    for kind, count in sorted(placed.items()):
        logger.info("quantized projections on the CPU: %d %s", count, kind)
    return placed
