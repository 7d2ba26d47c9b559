"""Weight-only int4 on the CPU: the projections' weights as 4-bit codes with a scale and an offset
per group of 32 inputs (the layout of llama.cpp's Q4_1).

Decoding one token reads every weight once, so a step at low concurrency costs what the weight
bytes cost to stream from memory, and 4-bit codes are a quarter of bf16's bytes. Each
``nn.Linear`` in the decoder layers (fused ones included) becomes an ``Int4Linear``. Per output
row and group ``g`` of ``GROUP_SIZE`` inputs::

    weight[n, k] ≈ (code[n, k] - 8) * scale[g, n] + offset[g, n],   code in 0..15

with ``scale = (max - min) / 15`` and ``offset = min + 8 * scale`` over the group (both bf16),
so the group's smallest weight is code 0 and its largest code 15. A checkpoint that was Q4_1
already (the embedded SmolLM2 GGUF's layers) keeps its values up to the bf16 rounding of the
scale and offset.

Two kernels multiply by these weights, chosen per call by the number of rows (tokens):

- up to ``MAX_KERNEL_ROWS``: torch's int4 kernel (``aten._weight_int4pack_mm_for_cpu``) reads
  the 4-bit codes;
- more rows (prefill chunks, large decode batches): oneDNN's bf16 GEMM reads a bf16 copy of the
  same dequantized weights, packed once at load (as ``cpu_linears.PackedLinear``), because
  torch's int4 kernel's cost grows with every row while the GEMM's barely does.

Measured on this 2-core box, SmolLM2-135M's 30 layers of projections, bf16 activations
(docs/measurements/cpu-kernels.md): the int4 kernel takes 3.9 ms at 1 row against 14.9 ms for the
packed bf16 GEMM, 11.0 against 11.6 ms at 8 rows, and 16.4 against 13.2 ms at 12. So the memory cost
is the bf16 copy plus the codes (1.28x bf16 weights): this mode buys decode latency, not
memory.

The LM head stays a bf16 ``PackedLinear`` (``engine/platform/cpu/linears.py``): the embedded GGUF
keeps its tied embeddings at 8 bits (Q8_0), and rounding them to 4 bits would change the model's
tokens far more than its layers' Q4_1 codes do. The activations are rounded to bf16 for both
kernels and the output returned in the input's dtype (torch's int4 kernel has no fast fp32
path: 30 layers at 1 row take 98 ms with fp32 activations).

This is an approximation of the model, not the model: docs/measurements/cpu-kernels.md reports how
often its greedy tokens agree with Hugging Face's and where it pays.
"""

from __future__ import annotations

import torch
from torch import nn

from paged_serve.engine.model.experts_swap import swap_experts
from paged_serve.engine.model.fused_projections import linear_from
from paged_serve.engine.model.linear_swap import swap_linears
from paged_serve.engine.model.packed_weights import PackedWeights, pack, packed_linear
from paged_serve.engine.platform.platform import Platform

GROUP_SIZE = 32  # inputs per scale and offset, as llama.cpp's Q4_1
MAX_KERNEL_ROWS = 8  # more rows go to the bf16 GEMM (faster from about 10 rows: measured)
OUT_MULTIPLE = 16  # torch's int4 packing needs the output count to be a multiple of this


def quantize_groups(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, ...]:
    """``weight [N, K]`` (K a multiple of ``group_size``) as ``(codes [N, K] int32 in 0..15,
    scale [N, K/group] bf16, offset [N, K/group] bf16)``; each code is the nearest one to the
    weight given the rounded scale and offset."""
    n, k = weight.shape
    groups = weight.detach().float().reshape(n, k // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / 15).clamp(min=torch.finfo(torch.bfloat16).tiny).to(torch.bfloat16)
    offset = (low + 8 * scale.float()).to(torch.bfloat16)
    codes = torch.round((groups - offset.float()[..., None]) / scale.float()[..., None]) + 8
    return codes.clamp(0, 15).to(torch.int32).reshape(n, k), scale, offset


def dequantize(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The weights ``quantize_groups`` stands for, ``[N, K]`` in fp32."""
    n, k = codes.shape
    groups = codes.float().view(n, scale.shape[1], -1) - 8
    return (groups * scale.float()[..., None] + offset.float()[..., None]).view(n, k)


class Int4Linear(PackedWeights, nn.Module):
    """``y = bf16(x) @ W.T + bias`` for ``x [..., in_features]``, in x's dtype, where ``W`` is
    ``dequantize(*quantize_groups(linear.weight))``.

    ``in_features`` must be a multiple of ``GROUP_SIZE`` and ``out_features`` of
    ``OUT_MULTIPLE`` (``fits`` says whether a module does). Holds only the kernels' layouts
    (opaque): the codes two to a byte with the scales and offsets, and the bf16 copy.
    """

    PACKED = ("_dense",)
    PACKED_ROWS = 1

    def __init__(self, linear: nn.Linear):
        super().__init__()
        if not fits(linear):
            raise ValueError(
                f"int4 needs in_features % {GROUP_SIZE} == 0 and out_features % {OUT_MULTIPLE}"
                f" == 0, got {linear.in_features} and {linear.out_features}"
            )
        self.in_features, self.out_features = linear.in_features, linear.out_features
        codes, scale, offset = quantize_groups(linear.weight)
        self.bias = linear.bias
        self._packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        self._scale_offset = torch.stack([scale, offset], dim=-1).transpose(0, 1).contiguous()
        dense = dequantize(codes, scale, offset).to(torch.bfloat16)
        self._dense = pack(dense, self.PACKED_ROWS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (  # a decode step's rows as they come: the kernel alone (7 us less a call)
            x.dtype == torch.bfloat16
            and x.dim() == 2
            and x.shape[0] <= MAX_KERNEL_ROWS
            and self.bias is None
            and x.is_contiguous()
        ):
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                x, self._packed, GROUP_SIZE, self._scale_offset
            )
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        if rows.shape[0] <= MAX_KERNEL_ROWS:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                rows, self._packed, GROUP_SIZE, self._scale_offset
            )
        else:
            y = packed_linear(rows, self._dense)
        y = y.view(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias


class Int4Experts(nn.Module):
    """One projection of every expert of a mixture-of-experts layer, ``[E, out, in]``, as an
    ``Int4Linear`` per expert: ``linear(x, e)`` is expert ``e``'s (engine/platform/cpu/moe.py
    calls it for the experts a step chose)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self._shape = tuple(weight.shape)
        self.parts = nn.ModuleList(
            Int4Linear(linear_from(w.detach().contiguous(), None)) for w in weight
        )

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._shape)

    def linear(
        self, x: torch.Tensor, expert: int, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        y = self.parts[expert](x)
        return y if bias is None else y + bias


def int4_experts(weight: torch.Tensor) -> Int4Experts | None:
    """``weight [E, out, in]`` as ``Int4Experts``, or None where the int4 kernel does not take
    its shape (the experts then stay as loaded)."""
    _, out_features, in_features = weight.shape
    if in_features % GROUP_SIZE or out_features % OUT_MULTIPLE:
        return None
    return Int4Experts(weight)


def fits(linear: nn.Linear) -> bool:
    """Whether torch's int4 kernel takes this projection's shape."""
    return linear.in_features % GROUP_SIZE == 0 and linear.out_features % OUT_MULTIPLE == 0


@torch.no_grad()
def quantize_int4(model: nn.Module, platform: Platform) -> int:
    """Swap every ``nn.Linear`` of the decoder layers whose shape fits for ``Int4Linear``, and
    every mixture-of-experts layer's experts whose shapes fit for ``Int4Experts``, in place;
    returns how many were swapped (the LM head and misfits stay as they are). Raises
    ValueError where ``platform`` (the model's device's) does not run it: off the CPU (the
    kernels are torch's CPU ones)."""
    platform.check_quantization("int4")
    head = model.get_output_embeddings()
    swapped = swap_linears(
        model, lambda linear: Int4Linear(linear) if fits(linear) and linear is not head else None
    )
    return swapped + swap_experts(model, int4_experts)
