"""Tensor-parallel slices of a stored-quantized projection (``engine/model/sharding.py``):
a column-parallel rank keeps a range of output rows, a row-parallel rank a range of inputs.

What each layout keeps for outputs ``[a, b)`` and inputs ``[a, b)`` (``N`` outputs, ``K`` inputs):

    layout        outputs [a, b)                        inputs [a, b)
    PackedInt     qweight, scales, zeros: columns a:b    qweight rows a/pack : b/pack, scales and
                                                         zeros rows a/g : b/g (a, b multiples of
                                                         the group and of the codes a word holds)
    ScaledFp8     weight rows; block scales' rows        weight columns; block scales' columns
                  a/bn : ceil(b/bn) (a, b multiples of   a/bk : ceil(b/bk) (multiples of bk);
                  bn, or b = N); channel scales a:b      channel and tensor scales whole
    ScaledInt8    weight rows, scales a:b                weight columns, scales whole

A mixture-of-experts projection (``IntExperts``, ``Fp8Experts``) is sliced expert by expert the
same way (``expert_outputs``, ``expert_inputs``).

A slice whose edge would cut a group, a packed word or a scale block is a ValueError naming the
layout and the numbers, as is a row-parallel slice of an act-order (``perm``) weight: its rows
are sorted by group, so one rank's inputs are scattered over every group. Every slice holds the
same dequantized values as the matching slice of the whole weight (tests/engine/quant).
"""

from __future__ import annotations

import torch

from paged_serve.engine.quant.linear import QuantizedLinear, join_outputs
from paged_serve.engine.quant.weights import PackedInt, QuantizedWeight, ScaledFp8, ScaledInt8
from paged_serve.kernels.interface import ExpertWeights, Fp8Experts, IntExperts


def _own(t: torch.Tensor | None) -> torch.Tensor | None:
    """A slice in memory of its own, so the whole tensor can be freed."""
    return None if t is None else t.clone(memory_format=torch.contiguous_format)


def _check_edges(what: str, edges: tuple[int, ...], multiple: int, end: int) -> None:
    bad = [e for e in edges if e % multiple and e != end]
    if bad:
        raise ValueError(
            f"tensor parallelism: {what} edge {bad[0]} is not a multiple of {multiple}; choose a "
            "tensor_parallel_size whose slices keep whole groups"
        )


def output_rows(weight: QuantizedWeight, a: int, b: int) -> QuantizedWeight:
    """Outputs ``[a, b)`` of ``weight`` (module docstring)."""
    n = weight.shape[0]
    if isinstance(weight, PackedInt):
        return PackedInt(
            qweight=_own(weight.qweight[:, a:b]),
            scales=_own(weight.scales[:, a:b]),
            zeros=_own(None if weight.zeros is None else weight.zeros[:, a:b]),
            perm=weight.perm,
            bits=weight.bits,
            group_size=weight.group_size,
        )
    if isinstance(weight, ScaledInt8):
        return ScaledInt8(_own(weight.weight[a:b]), _own(weight.scale[a:b]))
    scale = weight.scale
    if weight.block is not None:
        bn = weight.block[0]
        _check_edges(f"FP8 {bn}-row scale block: output", (a, b), bn, n)
        scale = scale[a // bn : -(-b // bn)]
    elif scale.dim() == 1:
        scale = scale[a:b]
    return ScaledFp8(_own(weight.weight[a:b]), _own(scale), weight.block)


def input_columns(weight: QuantizedWeight, a: int, b: int) -> QuantizedWeight:
    """Inputs ``[a, b)`` of ``weight`` (module docstring)."""
    k = weight.shape[1]
    if isinstance(weight, PackedInt):
        if weight.perm is not None:
            raise ValueError(
                "tensor parallelism: a row-parallel projection of an act-order (desc_act) "
                "checkpoint is not served: its inputs are sorted by group, so a rank's inputs "
                "lie in every group"
            )
        pack = 32 // weight.bits
        group = k if weight.group_size == -1 else weight.group_size
        _check_edges(f"{weight.bits}-bit word of {pack} codes: input", (a, b), pack, k)
        if weight.group_size != -1:
            _check_edges(f"group of {group} inputs: input", (a, b), group, k)
            scales = weight.scales[a // group : -(-b // group)]
            zeros = None if weight.zeros is None else weight.zeros[a // group : -(-b // group)]
        else:
            scales, zeros = weight.scales, weight.zeros
        return PackedInt(
            qweight=_own(weight.qweight[a // pack : -(-b // pack)]),
            scales=_own(scales),
            zeros=_own(zeros),
            perm=None,
            bits=weight.bits,
            group_size=weight.group_size,
        )
    if isinstance(weight, ScaledInt8):
        return ScaledInt8(_own(weight.weight[:, a:b]), weight.scale)
    scale = weight.scale
    if weight.block is not None:
        bk = weight.block[1]
        _check_edges(f"FP8 {bk}-column scale block: input", (a, b), bk, k)
        scale = _own(scale[:, a // bk : -(-b // bk)])
    return ScaledFp8(_own(weight.weight[:, a:b]), scale, weight.block)


def output_ranges(weight: QuantizedWeight, ranges: tuple[tuple[int, int], ...]) -> QuantizedWeight:
    """Outputs ``ranges`` of ``weight``, concatenated (a DeltaNet's q, k, v blocks)."""
    parts = [output_rows(weight, a, b) for a, b in ranges]
    joined = parts[0] if len(parts) == 1 else join_outputs(parts)
    if joined is None:
        raise ValueError("tensor parallelism: these quantized output ranges cannot be joined")
    return joined


def rows_of(module: QuantizedLinear, ranges: tuple[tuple[int, int], ...]) -> QuantizedLinear:
    """Column-parallel: ``module``'s output rows ``ranges``, concatenated, as one projection."""
    bias = None
    if module.bias is not None:
        bias = torch.cat([module.bias.detach()[a:b] for a, b in ranges]).clone()
    part = QuantizedLinear(output_ranges(module.stored, ranges), bias)
    part.kernel = module.kernel
    return part


def columns_of(module: QuantizedLinear, a: int, b: int) -> QuantizedLinear:
    """Row-parallel: ``module``'s inputs ``[a, b)`` without its bias (added once, after the
    ranks' sum)."""
    part = QuantizedLinear(input_columns(module.stored, a, b), None)
    part.kernel = module.kernel
    return part


def _per_expert(weights: ExpertWeights) -> list[QuantizedWeight]:
    """Each expert's weight as the 2-D layout it was stacked from."""
    if isinstance(weights, IntExperts):
        zeros = weights.zeros
        return [
            PackedInt(
                weights.qweight[e],
                weights.scales[e],
                None if zeros is None else zeros[e],
                None,
                weights.bits,
                weights.group_size,
            )
            for e in range(weights.qweight.shape[0])
        ]
    return [
        ScaledFp8(weights.weight[e], weights.scale[e], weights.block)
        for e in range(weights.weight.shape[0])
    ]


def _restacked(parts: list[QuantizedWeight]) -> ExpertWeights:
    first = parts[0]
    if isinstance(first, PackedInt):
        zeros = None if first.zeros is None else torch.stack([p.zeros for p in parts])
        return IntExperts(
            qweight=torch.stack([p.qweight for p in parts]),
            scales=torch.stack([p.scales for p in parts]),
            zeros=zeros,
            bits=first.bits,
            group_size=first.group_size,
        )
    return Fp8Experts(
        torch.stack([p.weight for p in parts]), torch.stack([p.scale for p in parts]), first.block
    )


def expert_outputs(weights: ExpertWeights, ranges: tuple[tuple[int, int], ...]) -> ExpertWeights:
    """Every expert's outputs ``ranges`` (``[E, out, in]`` layouts), concatenated: a rank's gate
    and up rows of the joined ``gate_up``."""
    return _restacked([output_ranges(w, ranges) for w in _per_expert(weights)])


def expert_inputs(weights: ExpertWeights, a: int, b: int) -> ExpertWeights:
    """Every expert's inputs ``[a, b)``: a rank's columns of ``down``."""
    return _restacked([input_columns(w, a, b) for w in _per_expert(weights)])
