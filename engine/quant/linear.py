"""The projection of a checkpoint stored quantized: ``y = x @ W^T + b`` with ``W`` kept in its
stored layout (``engine/quant/weights.py``), multiplied by the kernel its platform chose.

``QuantizedLinear.kernel`` is ``"torch"`` (the default, any device: the weight dequantized for
each call, then ``F.linear``; exact, slow, what a device without our kernels runs) or
``"triton"`` (``use_triton_kernels``: the W4A16/W8A16 GEMM of
``kernels/triton/quantized_gemm.py`` for packed integers, ``kernels/triton/scaled_gemm.py``'s
FP8 and int8 W8A8 GEMMs for ``ScaledFp8`` and ``ScaledInt8``, whose activations are quantized
at run time: per token, and per group of ``bk`` inputs with FP8 block scales). The CPU puts
its own modules in place (``engine/platform/cpu/quantized_linears.py``).

The stored tensors are buffers (they move and count with the model; not persistent: a checkpoint's
``qweight`` is in its format's layout, not this one); ``stored`` gives
them back as their layout's dataclass. ``concat`` joins projections that read one input (q/k/v,
gate/up: ``engine/model/fused_projections.py``) along the outputs where their layouts allow.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paged_serve.engine.quant.held_layout import held_layout, hold_layout, settings_repr
from paged_serve.engine.quant.weights import PackedInt, QuantizedWeight, ScaledFp8, ScaledInt8

KERNELS = ("torch", "triton")
LAYOUTS = {cls.__name__: cls for cls in (PackedInt, ScaledFp8, ScaledInt8)}


class QuantizedLinear(nn.Module):
    """``y = x @ dequantize(weight)^T + bias`` for ``x [..., in_features]``, in x's dtype."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.layout = type(weight).__name__
        self._settings = hold_layout(self, weight, optional=("zeros", "perm"))
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.kernel = "torch"

    @property
    def stored(self) -> QuantizedWeight:
        """The weight as its layout's dataclass (views of the buffers)."""
        return held_layout(self, LAYOUTS[self.layout], self._settings)

    def extra_repr(self) -> str:
        settings = settings_repr(self._settings)
        return f"{self.in_features} -> {self.out_features}, {self.layout}({settings})"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.kernel == "triton":
            y = _triton_product(rows, self.stored, self.bias)
        else:
            y = F.linear(rows, self.stored.dequantize().to(rows.dtype), self.bias)
        return y.view(*x.shape[:-1], self.out_features)


def _triton_product(
    rows: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """``rows [M, K] @ W^T + bias`` on the Triton kernel of ``weight``'s layout (imported here:
    Triton must not load before TRITON_INTERPRET is decided)."""
    rows = rows.contiguous()
    if isinstance(weight, PackedInt):
        from paged_serve.kernels.triton.quantized_gemm import quantized_gemm

        if weight.perm is not None:  # act-order: the rows of qweight are inputs perm[k]
            rows = rows.index_select(1, weight.perm)
        return quantized_gemm(
            rows,
            weight.qweight,
            weight.scales,
            weight.zeros,
            bits=weight.bits,
            group_size=weight.group_size,
            bias=bias,
        )
    if isinstance(weight, ScaledFp8):
        from paged_serve.kernels.triton.scaled_gemm import fp8_gemm

        return fp8_gemm(rows, weight.weight, weight.scale, block_size=weight.block, bias=bias)
    from paged_serve.kernels.triton.scaled_gemm import int8_gemm

    return int8_gemm(rows, weight.weight, weight.scale, bias=bias)


def quantized_linears(model: nn.Module) -> list[QuantizedLinear]:
    """Every ``QuantizedLinear`` in ``model``."""
    return [m for m in model.modules() if isinstance(m, QuantizedLinear)]


def use_triton_kernels(model: nn.Module) -> int:
    """Point every ``QuantizedLinear`` of ``model`` at its Triton kernel; returns how many."""
    modules = quantized_linears(model)
    for module in modules:
        module.kernel = "triton"
    return len(modules)


def concat(parts: list[QuantizedLinear]) -> QuantizedLinear | None:
    """One ``QuantizedLinear`` whose outputs are ``parts``' outputs in order (same inputs), or
    None where their layouts cannot be joined: different layouts, bits, groups or act-order
    permutations, or FP8 blocks that an output boundary would cut."""
    if not parts or any(not isinstance(p, QuantizedLinear) for p in parts):
        return None
    weights = [p.stored for p in parts]
    biases = {p.bias is None for p in parts}
    if len(biases) != 1 or len({type(w) for w in weights}) != 1:
        return None
    joined = join_outputs(weights)
    if joined is None:
        return None
    bias = None if biases.pop() else torch.cat([p.bias for p in parts])
    fused = QuantizedLinear(joined, bias)
    fused.kernel = parts[0].kernel
    return fused


def join_outputs(weights: list[QuantizedWeight]) -> QuantizedWeight | None:
    """One weight whose outputs are ``weights``' outputs in order (same inputs and layout), or
    None where their layouts cannot be joined (``concat``)."""
    first = weights[0]
    if isinstance(first, PackedInt):
        same = {(w.bits, w.group_size, w.qweight.shape[0]) for w in weights}
        perms = [w.perm for w in weights]
        if len(same) != 1 or not all(_same_perm(perms[0], p) for p in perms):
            return None
        zeros = None
        if any(w.zeros is not None for w in weights):
            zeros = torch.cat([_zeros_of(w) for w in weights], dim=1)
        return PackedInt(
            qweight=torch.cat([w.qweight for w in weights], dim=1),
            scales=torch.cat([w.scales for w in weights], dim=1),
            zeros=zeros,
            perm=first.perm,
            bits=first.bits,
            group_size=first.group_size,
        )
    if isinstance(first, ScaledInt8):
        return ScaledInt8(
            torch.cat([w.weight for w in weights]), torch.cat([w.scale for w in weights])
        )
    if len({w.block for w in weights}) != 1:
        return None
    if first.block is not None:
        if any(w.weight.shape[0] % first.block[0] for w in weights[:-1]):
            return None  # a part's last block row would hold the next part's rows
        scale = torch.cat([w.scale for w in weights])
    else:  # per tensor or per channel: per channel, joined
        scale = torch.cat([w.scale.expand(w.weight.shape[0]) for w in weights])
    return ScaledFp8(torch.cat([w.weight for w in weights]), scale.contiguous(), first.block)


def _same_perm(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _zeros_of(weight: PackedInt) -> torch.Tensor:
    """Integer zero points ``[G, N]`` (the symmetric ``2^(bits-1)`` written out)."""
    if weight.zeros is not None:
        return weight.zeros
    return torch.full_like(weight.scales, 1 << (weight.bits - 1), dtype=torch.uint8)
