"""A mixture-of-experts projection kept in a checkpoint's quantized layout: every expert's
weights stacked, never a full-precision copy.

A checkpoint stores each expert's projections on their own (``experts.{e}.gate_proj``,
``up_proj``, ``down_proj``; Mixtral's ``w1``, ``w3``, ``w2``), each in one of
``engine/quant/weights.py``'s layouts. ``stack_experts`` joins each expert's parts along the
outputs (gate then up, as the fused ``gate_up_proj``) and stacks the experts into the layout the
fused MoE kernel reads (``kernels/interface.py``):

* ``PackedInt`` (GPTQ, AWQ, compressed-tensors W4A16/W8A16) -> ``IntExperts``: codes, group
  scales and zeros stacked (``[E, K / pack, N]``, ``[E, G, N]``); symmetric experts beside
  asymmetric ones get their zeros written out;
* ``ScaledInt8`` (compressed-tensors W8A8 int8, channel) -> ``IntExperts`` of 8 bits, one group:
  the codes ``w + 128`` with the symmetric zero 128 are the same values, repacked;
* ``ScaledFp8`` -> ``Fp8Experts``: a tensor scale becomes a row scale; block scales whose block
  height does not divide a part's rows (gate/up of 64 rows in blocks of 128) are written out per
  row (blocks of ``1 x bk``), so the join cuts no block.

What cannot be stacked raises ``ExpertsNotStacked`` naming why (act-order integer experts,
experts of different bits, group sizes or shapes, a mix of layouts); the loader then
dequantizes those experts at load instead (engine/model/quantized_loading.py).

``StoredExperts`` holds the stacked tensors as buffers. On the triton backend
(``engine/model/experts_swap.py``) its ``stored`` layout goes to the Triton fused MoE, which
dequantizes each weight tile inside the tile; the torch backend's grouped pass
(``engine/platform/cpu/moe.py``) calls ``linear(x, e)``, which dequantizes expert ``e``'s
weight for the call (``dequantize_experts_ref``) and multiplies: the products of the
dequantized weights, as exact as ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paged_serve.engine.quant.held_layout import held_layout, hold_layout, settings_repr
from paged_serve.engine.quant.linear import join_outputs
from paged_serve.engine.quant.weights import PackedInt, QuantizedWeight, ScaledFp8, ScaledInt8
from paged_serve.kernels.interface import ExpertWeights, Fp8Experts, IntExperts
from paged_serve.kernels.reference import dequantize_experts_ref, pack_int_ref

LAYOUTS = {cls.__name__: cls for cls in (IntExperts, Fp8Experts)}
# the kernel's K step (kernels/triton/quantized_moe.py BLOCK_K, not imported: Triton must not
# load before TRITON_INTERPRET is decided): group sizes and FP8 block widths are multiples of it
KERNEL_BLOCK_K = 32


class ExpertsNotStacked(ValueError):
    """The experts' stored layouts cannot be stacked into one the kernel reads (why: the
    message)."""


class StoredExperts(nn.Module):
    """One projection of every expert, ``[E, out, in]``, held in its stored layout
    (``IntExperts`` or ``Fp8Experts``; module docstring)."""

    def __init__(self, weights: ExpertWeights):
        super().__init__()
        self.layout = type(weights).__name__
        self._shape = weights.shape
        self._settings = hold_layout(self, weights, optional=("zeros",))

    @property
    def shape(self) -> torch.Size:
        """``(E, out, in)``."""
        return self._shape

    @property
    def stored(self) -> ExpertWeights:
        """The weights as their layout's dataclass (views of the buffers)."""
        return held_layout(self, LAYOUTS[self.layout], self._settings)

    def extra_repr(self) -> str:
        return f"{tuple(self._shape)}, {self.layout}({settings_repr(self._settings)})"

    def linear(
        self, x: torch.Tensor, expert: int, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x [M, in] @ W_e^T + bias``, ``W_e`` dequantized for the call into x's dtype."""
        weight = dequantize_experts_ref(self.stored.expert(expert))[0]
        return F.linear(x, weight.to(x.dtype), bias)


def stack_experts(experts: list[list[QuantizedWeight]]) -> ExpertWeights:
    """Per expert, its parts (joined along the outputs, in order) stacked into one layout the
    fused MoE kernel reads; ``ExpertsNotStacked`` naming why where they cannot be."""
    kinds = {type(w).__name__ for parts in experts for w in parts}
    if len(kinds) != 1:
        raise ExpertsNotStacked(f"the experts mix layouts ({', '.join(sorted(kinds))})")
    joined = [_joined(parts) for parts in experts]
    if len({w.shape for w in joined}) != 1:
        raise ExpertsNotStacked(f"the experts' shapes differ ({sorted({w.shape for w in joined})})")
    first = joined[0]
    if isinstance(first, ScaledFp8):
        return _stacked_fp8(joined)
    if isinstance(first, ScaledInt8):
        joined = [_as_packed(w) for w in joined]
    return _stacked_int(joined)


def _joined(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """One expert's parts joined along the outputs."""
    if any(isinstance(p, PackedInt) and p.perm is not None for p in parts):
        raise ExpertsNotStacked("act-order (g_idx) experts: the fused MoE reads inputs in order")
    if isinstance(parts[0], ScaledFp8):
        parts = [_fp8_rows_fit(p, parts) for p in parts]
    if len(parts) == 1:
        return parts[0]
    joined = join_outputs(parts)
    if joined is None:
        described = ", ".join(_describe(p) for p in parts)
        raise ExpertsNotStacked(f"an expert's parts cannot be joined ({described})")
    return joined


def _fp8_rows_fit(part: ScaledFp8, parts: list[ScaledFp8]) -> ScaledFp8:
    """``part`` with a scale per row (tensor scale) or per ``1 x bk`` block where a block
    height would cut a join (module docstring); as it is otherwise."""
    if part.block is None:
        return ScaledFp8(part.weight, part.scale.expand(part.weight.shape[0]).contiguous(), None)
    bn, bk = part.block
    if len(parts) == 1 or all(p.weight.shape[0] % bn == 0 for p in parts[:-1]):
        return part
    rows = part.scale.repeat_interleave(bn, 0)[: part.weight.shape[0]].contiguous()
    return ScaledFp8(part.weight, rows, (1, bk))


def _as_packed(weight: ScaledInt8) -> PackedInt:
    """int8 ``w`` with a row scale as 8-bit codes ``w + 128``, zero 128, one group: the same
    values."""
    codes = (weight.weight.to(torch.int32) + 128).t().contiguous()  # [K, N]
    return PackedInt(pack_int_ref(codes, 8), weight.scale.float()[None, :], None, None, 8, -1)


def _stacked_int(joined: list[PackedInt]) -> IntExperts:
    first = joined[0]
    settings = {(w.bits, w.group_size) for w in joined}
    if len(settings) != 1:
        raise ExpertsNotStacked(f"the experts' bits and group sizes differ ({sorted(settings)})")
    if first.group_size != -1 and first.group_size % KERNEL_BLOCK_K:
        raise ExpertsNotStacked(
            f"group size {first.group_size}: the kernel reads groups of a multiple of "
            f"{KERNEL_BLOCK_K} inputs"
        )
    zeros = None
    if any(w.zeros is not None for w in joined):
        symmetric = 1 << (first.bits - 1)
        zeros = torch.stack(
            [
                w.zeros if w.zeros is not None else torch.full_like(w.scales, symmetric).byte()
                for w in joined
            ]
        )
    return IntExperts(
        qweight=torch.stack([w.qweight for w in joined]),
        scales=torch.stack([w.scales.float() for w in joined]),
        zeros=zeros,
        bits=first.bits,
        group_size=first.group_size,
    )


def _stacked_fp8(joined: list[ScaledFp8]) -> Fp8Experts:
    blocks = {w.block for w in joined}
    if len(blocks) != 1:
        raise ExpertsNotStacked(f"the experts' FP8 blocks differ ({sorted(map(str, blocks))})")
    block = blocks.pop()
    if block is not None and block[1] % KERNEL_BLOCK_K:
        raise ExpertsNotStacked(
            f"FP8 blocks {block[0]}x{block[1]}: the kernel reads block widths of a multiple of "
            f"{KERNEL_BLOCK_K} inputs"
        )
    scales = [w.scale.float() for w in joined]
    if block is None:
        scales = [s.expand(w.weight.shape[0]) for s, w in zip(scales, joined)]
    return Fp8Experts(
        weight=torch.stack([w.weight for w in joined]),
        scale=torch.stack(scales).contiguous(),
        block=block,
    )


def _describe(weight: QuantizedWeight) -> str:
    if isinstance(weight, PackedInt):
        return f"{weight.bits}-bit g{weight.group_size} {tuple(weight.shape)}"
    if isinstance(weight, ScaledFp8):
        return f"FP8 block {weight.block} {tuple(weight.shape)}"
    return f"int8 {tuple(weight.shape)}"
