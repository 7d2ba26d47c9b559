"""The layouts every stored format is read into, one per kind of weight, with the values each
stands for (``dequantize``: ``[N, K]`` fp32 for a projection of ``K`` inputs and ``N`` outputs).

``PackedInt`` (GPTQ, AWQ, compressed-tensors' pack-quantized; 4 or 8 bits) is the layout of the
Triton GEMM (``kernels/triton/quantized_gemm.py``)::

    qweight [K / pack, N] int32   pack = 32 / bits codes a word, packed along K, low bits first
    scales  [G, N] fp32           G = K / group_size (per-channel: G = 1)
    zeros   [G, N] uint8 | None   None: symmetric, the zero is 2^(bits-1)
    perm    [K] int64 | None      act-order: row k of qweight is input feature perm[k]

    w[n, perm[k]] = (q[k, n] - zero[k // group_size, n]) * scale[k // group_size, n]

An act-order checkpoint (GPTQ's ``g_idx`` not sorted) assigns inputs to groups out of order; its
rows are sorted by group once at load, so each group is contiguous again, and the projection
gathers its input's columns by ``perm`` before the product (vLLM's exllama path does the same).

``ScaledFp8`` (compressed-tensors' float-quantized, the ``fp8`` method) keeps the stored
``[N, K]`` e4m3 weight with its scale: one for the tensor, one per output row, or one per block
of ``bn x bk`` (``w = weight * scale[n // bn, k // bk]``). ``ScaledInt8`` (int-quantized W8A8)
keeps the ``[N, K]`` int8 weight with one scale per output row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_serve.kernels.reference import dequantize_ref, pack_int_ref, unpack_int_ref

SUPPORTED_BITS = (4, 8)


@dataclass(frozen=True, slots=True)
class PackedInt:
    """4- or 8-bit integer codes with group scales (module docstring)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    perm: torch.Tensor | None
    bits: int
    group_size: int  # inputs per scale; -1: one group over K

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)``: outputs, inputs."""
        return self.qweight.shape[1], self.qweight.shape[0] * (32 // self.bits)

    def codes(self) -> torch.Tensor:
        """``[K, N]`` int32 codes, in the rows' (sorted) order."""
        return unpack_int_ref(self.qweight, self.bits)

    def dequantize(self) -> torch.Tensor:
        """``[N, K]`` fp32 in the inputs' own order."""
        w = dequantize_ref(
            self.qweight, self.scales, self.zeros, bits=self.bits, group_size=self.group_size
        )
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out


@dataclass(frozen=True, slots=True)
class ScaledFp8:
    """An e4m3 ``weight [N, K]`` and its fp32 ``scale``: ``[]`` (tensor), ``[N]`` (channel) or
    ``[ceil(N / bn), ceil(K / bk)]`` with ``block = (bn, bk)``."""

    weight: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int] | None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def dequantize(self) -> torch.Tensor:
        """``[N, K]`` fp32."""
        w = self.weight.float()
        if self.block is None:
            scale = self.scale.float()
            return w * (scale[:, None] if scale.dim() == 1 else scale)
        bn, bk = self.block
        n, k = w.shape
        per_element = self.scale.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)
        return w * per_element[:n, :k]


@dataclass(frozen=True, slots=True)
class ScaledInt8:
    """An int8 ``weight [N, K]`` (symmetric) with one fp32 ``scale [N]`` per output row."""

    weight: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def dequantize(self) -> torch.Tensor:
        """``[N, K]`` fp32."""
        return self.weight.float() * self.scale.float()[:, None]


QuantizedWeight = PackedInt | ScaledFp8 | ScaledInt8


def unpack_columns(packed: torch.Tensor, bits: int, order: tuple[int, ...] | None = None):
    """``[R, C * pack]`` int32 codes of ``packed [R, C]`` packed along its columns, low bits
    first; ``order[i]`` is the column within each word's ``pack`` that bits ``i * bits`` hold
    (AWQ interleaves; None: in order)."""
    pack = 32 // bits
    shifts = torch.arange(pack, dtype=torch.int64, device=packed.device) * bits
    values = (packed.to(torch.int64)[:, :, None] >> shifts) & ((1 << bits) - 1)  # [R, C, pack]
    if order is not None:
        values = values[:, :, torch.argsort(torch.tensor(order, device=packed.device))]
    return values.reshape(packed.shape[0], -1).to(torch.int32)


def sorted_by_group(
    codes: torch.Tensor, g_idx: torch.Tensor, group_size: int, where: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(codes [K, N] with rows sorted by group, perm or None)`` for an act-order assignment
    ``g_idx [K]``; None when the inputs are already in group order. ValueError naming ``where``
    when the groups do not hold ``group_size`` inputs each (sorting could not make them the
    contiguous groups the kernels read)."""
    k = codes.shape[0]
    g_idx = g_idx.to(torch.int64)
    natural = torch.arange(k, device=g_idx.device) // group_size
    if torch.equal(g_idx, natural):
        return codes, None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], natural):
        raise ValueError(
            f"{where}: g_idx does not assign {group_size} inputs to each group, so its groups "
            "cannot be made contiguous"
        )
    return codes[perm], perm


def packed_int(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    *,
    bits: int,
    group_size: int,
    perm: torch.Tensor | None = None,
) -> PackedInt:
    """The ``PackedInt`` of ``codes [K, N]`` (rows in group order), ``scales [G, N]`` and integer
    ``zeros [G, N]`` (all equal to ``2^(bits-1)``: stored as None, the symmetric case)."""
    if zeros is not None and bool((zeros == 1 << (bits - 1)).all()):
        zeros = None
    return PackedInt(
        qweight=pack_int_ref(codes, bits),
        scales=scales.to(torch.float32).contiguous(),
        zeros=None if zeros is None else zeros.to(torch.uint8).contiguous(),
        perm=perm,
        bits=bits,
        group_size=group_size,
    )
