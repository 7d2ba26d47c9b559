"""The fused mixture-of-experts' grouped GEMM over experts stored quantized: each weight tile is
dequantized inside the tile, so the experts stay in their stored bytes.

Semantics are those of ``fused_moe_ref`` over ``dequantize_experts_ref(weights)``
(``kernels/reference.py``). ``kernels/triton/fused_moe.py`` sorts the pairs and calls
:func:`quantized_moe_gemm` for a projection whose weights are ``IntExperts`` or ``Fp8Experts``
(``kernels/interface.py``) instead of a plain ``[E, out, in]`` tensor; the grid, the rows each
program reads and what it does after the product (bias, routing weight, store) are those of its
``_moe_gemm_kernel``.

Layouts (per expert ``e``, ``N`` outputs, ``K`` inputs)::

    IntExperts  qweight [E, K / pack, N] int32   4 or 8 bits, packed along K, low bits first
                scales  [E, G, N] fp32           G = K / group_size (-1: one group)
                zeros   [E, G, N] uint8 | None   None: symmetric, 2^(bits-1)
    Fp8Experts  weight  [E, N, K] e4m3
                scale   [E, ceil(N / bn), ceil(K / bk)] fp32 (block (bn, bk)) | [E, N] (channel)

Each K step of ``BLOCK_K = 32`` inputs loads the expert's weight tile ``[BLOCK_K, BLOCK_N]``:
integers are unpacked into ``q - zero`` (``quantized_gemm.py``'s ``_load_dequantized_tile``),
e4m3 values converted; both are exact in fp16 and bf16 (at most 8-bit integers; e4m3's 3-bit
mantissa and exponent range lie inside both), so the dot's operands are the activations' own
values and the weight's exact stored values. ``BLOCK_K`` divides every group size and block
width the launcher takes, so a tile lies inside one group (one block column) and its scale is
one row ``[BLOCK_N]`` (for blocks: ``scale[e, n // bn, k // bk]`` per column), applied to the
tile's dot in fp32. The roundings are the fp32 accumulation and the scale's product.

FP8 is weight-only here: the activations stay in their dtype (no per-token FP8 quantization, no
FP8 tensor-core dot). Act-order integer experts (a permutation of the inputs) are not a layout
this kernel reads: the engine dequantizes those at load. Under the interpreter, bf16 operands
are cast to fp32 before the dots (its bf16 ``tl.dot`` is wrong, as
``kernels/triton/paged_attention.py`` notes).
"""

from __future__ import annotations

from typing import Protocol

import torch

import triton
import triton.language as tl
from paged_serve.kernels.interface import ExpertWeights, Fp8Experts, IntExperts
from paged_serve.kernels.triton.moe_rows import routed_rows, store_routed
from paged_serve.kernels.triton.quantized_gemm import _load_dequantized_tile
from paged_serve.kernels.triton.runtime import check_device, interpreting

BLOCK_N = 64
BLOCK_K = 32  # divides every accepted group size and FP8 block width: a tile has one scale row
SUPPORTED_BITS = (4, 8)
ZERO_DTYPES = (torch.uint8, torch.int32)


class AlignedPairs(Protocol):
    """The pairs sorted by expert, as ``fused_moe.align_pairs`` returns them (``RoutedPairs``;
    typed here, not imported: ``fused_moe`` imports this module)."""

    pair_ids: torch.Tensor
    block_experts: torch.Tensor
    num_pairs: int
    top_k: int
    block_m: int


@triton.jit
def _fp8_tile(w_ptr, offs_k, offs_n, k_mask, n_mask, stride_wk, stride_wn):
    """The e4m3 weight tile ``[BLOCK_K, BLOCK_N]`` in fp32 (0 where masked)."""
    w = tl.load(
        w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
        mask=k_mask[:, None] & n_mask[None, :],
        other=0.0,
    )
    return w.to(tl.float32)


@triton.jit
def _scale_row(scales_ptr, k0, offs_n, n_mask, group_k, scale_rows, stride_sg, stride_sn):
    """The tile's scales ``[BLOCK_N]``: group (block column) ``k0 // group_k``, row
    ``n // scale_rows`` (1: a scale per output; an FP8 block's height otherwise)."""
    group = (k0 // group_k).to(tl.int64)
    scale = tl.load(
        scales_ptr + group * stride_sg + (offs_n // scale_rows) * stride_sn,
        mask=n_mask,
        other=0.0,
    )
    return scale.to(tl.float32)


@triton.jit
def _moe_quantized_gemm_kernel(
    a_ptr,
    w_ptr,
    scales_ptr,
    zeros_ptr,
    bias_ptr,
    route_ptr,
    out_ptr,
    pair_ids_ptr,
    block_experts_ptr,
    num_pairs,
    top_k,
    N,
    K,
    group_k,
    scale_rows,
    stride_am,
    stride_we,
    stride_wk,
    stride_wn,
    stride_se,
    stride_sg,
    stride_sn,
    stride_ze,
    stride_zg,
    stride_be,
    stride_om,
    FP8: tl.constexpr,
    BITS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    A_PER_TOKEN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_ROUTE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1).to(tl.int64)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    pair, valid, a_row = routed_rows(pair_ids_ptr, pid_m, num_pairs, top_k, A_PER_TOKEN, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_base = w_ptr + expert * stride_we
    scales_base = scales_ptr + expert * stride_se
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
        k_mask = offs_k < K
        a = tl.load(
            a_ptr + a_row[:, None] * stride_am + offs_k[None, :],
            mask=valid[:, None] & k_mask[None, :],
            other=0.0,
        )
        if FP8:
            w = _fp8_tile(w_base, offs_k, offs_n, k_mask, n_mask, stride_wk, stride_wn)
        else:
            w = _load_dequantized_tile(
                w_base,
                zeros_ptr + expert * stride_ze,
                offs_k,
                offs_n,
                k_mask,
                n_mask,
                (k0 // group_k).to(tl.int64),
                stride_wk,
                stride_zg,
                BITS=BITS,
                HAS_ZEROS=HAS_ZEROS,
            )
        if DOT_FP32:
            a = a.to(tl.float32)
        else:
            w = w.to(a.dtype)  # exact: integers of at most 8 bits, or e4m3 values
        scale = _scale_row(
            scales_base, k0, offs_n, n_mask, group_k, scale_rows, stride_sg, stride_sn
        )
        acc += tl.dot(a, w, input_precision=DOT_PRECISION) * scale[None, :]
    store_routed(
        acc,
        out_ptr,
        bias_ptr,
        route_ptr,
        expert,
        pair,
        valid,
        offs_n,
        n_mask,
        stride_be,
        stride_om,
        HAS_BIAS=HAS_BIAS,
        MUL_ROUTE=MUL_ROUTE,
    )


def _int_launch(weights: IntExperts, k: int) -> dict:
    """The kernel's arguments for integer experts; ValueError naming what does not fit."""
    if weights.bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {weights.bits}")
    qweight, scales, zeros = weights.qweight, weights.scales, weights.zeros
    pack = 32 // weights.bits
    if qweight.dim() != 3 or qweight.dtype != torch.int32 or not qweight.is_contiguous():
        raise ValueError(
            f"qweight must be a contiguous [E, K / {pack}, N] int32, "
            f"got {tuple(qweight.shape)} {qweight.dtype}"
        )
    experts, rows, n = qweight.shape
    if rows * pack != k:
        raise ValueError(f"qweight holds {rows * pack} inputs of {weights.bits} bits; a has K={k}")
    if weights.group_size == -1:  # one group: every tile's, whatever K
        group_k, num_groups = triton.cdiv(k, BLOCK_K) * BLOCK_K, 1
    elif (
        weights.group_size > 0 and weights.group_size % BLOCK_K == 0 and k % weights.group_size == 0
    ):
        group_k, num_groups = weights.group_size, k // weights.group_size
    else:
        raise ValueError(
            f"group_size must be -1 or a multiple of {BLOCK_K} dividing K={k}, "
            f"got {weights.group_size}"
        )
    groups = (experts, num_groups, n)
    if scales.shape != groups or scales.dtype != torch.float32 or not scales.is_contiguous():
        raise ValueError(
            f"scales must be a contiguous {list(groups)} float32, "
            f"got {tuple(scales.shape)} {scales.dtype}"
        )
    if zeros is not None and (
        zeros.shape != groups or zeros.dtype not in ZERO_DTYPES or not zeros.is_contiguous()
    ):
        raise ValueError(
            f"zeros must be a contiguous {list(groups)} of {ZERO_DTYPES}, "
            f"got {tuple(zeros.shape)} {zeros.dtype}"
        )
    return dict(
        w=qweight,
        scales=scales,
        zeros=zeros if zeros is not None else qweight,
        group_k=group_k,
        scale_rows=1,
        strides_w=(qweight.stride(0), qweight.stride(1), qweight.stride(2)),
        strides_s=(scales.stride(0), scales.stride(1), scales.stride(2)),
        strides_z=(zeros.stride(0), zeros.stride(1)) if zeros is not None else (0, 0),
        fp8=False,
        bits=weights.bits,
        has_zeros=zeros is not None,
    )


def _fp8_launch(weights: Fp8Experts, k: int) -> dict:
    """The kernel's arguments for FP8 experts; ValueError naming what does not fit."""
    weight, scale = weights.weight, weights.scale
    if weight.dim() != 3 or weight.dtype != torch.float8_e4m3fn or weight.stride(-1) != 1:
        raise ValueError(
            f"weight must be [E, N, K] float8_e4m3fn with contiguous rows, "
            f"got {tuple(weight.shape)} {weight.dtype} strides {weight.stride()}"
        )
    experts, n, k_w = weight.shape
    if k_w != k:
        raise ValueError(f"weight takes {k_w} inputs; a has K={k}")
    if scale.dtype != torch.float32:
        raise ValueError(f"scale must be float32, got {scale.dtype}")
    if weights.block is None:  # per channel: one group over K, a scale per row
        if scale.shape != (experts, n):
            raise ValueError(f"channel scale must be [{experts}, {n}], got {tuple(scale.shape)}")
        group_k, scale_rows = triton.cdiv(k, BLOCK_K) * BLOCK_K, 1
        strides_s = (scale.stride(0), 0, scale.stride(1))
    else:
        bn, bk = weights.block
        if bn <= 0 or bk <= 0 or bk % BLOCK_K:
            raise ValueError(f"block must be positive, its width a multiple of {BLOCK_K}: {bn, bk}")
        blocks = (experts, triton.cdiv(n, bn), triton.cdiv(k, bk))
        if scale.shape != blocks:
            raise ValueError(f"block scale must be {list(blocks)}, got {tuple(scale.shape)}")
        group_k, scale_rows = bk, bn
        strides_s = (scale.stride(0), scale.stride(2), scale.stride(1))
    return dict(
        w=weight,
        scales=scale,
        zeros=scale,
        group_k=group_k,
        scale_rows=scale_rows,
        strides_w=(weight.stride(0), weight.stride(2), weight.stride(1)),
        strides_s=strides_s,
        strides_z=(0, 0),
        fp8=True,
        bits=8,
        has_zeros=False,
    )


def quantized_moe_gemm(
    a: torch.Tensor,
    weight: ExpertWeights,
    pairs: AlignedPairs,
    *,
    per_token: bool,
    bias: torch.Tensor | None = None,
    route_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """``fused_moe.moe_gemm`` with quantized experts: row ``p`` of the ``[S, N]`` result is
    ``a[p // k]`` (``per_token``) or ``a[p]`` times ``dequant(weight)[e_p]^T``, plus
    ``bias[e_p]`` (``[E, N]``), times ``route_weights[p]`` when given. a: ``[*, K]`` fp16, bf16
    or fp32 with contiguous rows; weight: ``IntExperts`` or ``Fp8Experts`` (module docstring)."""
    check_device(a)
    if a.stride(-1) != 1 or a.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(
            f"a must be fp16, bf16 or fp32 with contiguous rows, got {a.dtype} {a.stride()}"
        )
    k = a.shape[-1]
    if isinstance(weight, IntExperts):
        launch = _int_launch(weight, k)
    elif isinstance(weight, Fp8Experts):
        launch = _fp8_launch(weight, k)
    else:
        raise ValueError(f"weight must be IntExperts or Fp8Experts, got {type(weight).__name__}")
    num_experts, n, _ = weight.shape
    if bias is not None and (bias.shape != (num_experts, n) or bias.stride(-1) != 1):
        raise ValueError(f"bias must be [{num_experts}, {n}] with contiguous rows")
    for name, t in (("weight", launch["w"]), ("scales", launch["scales"]), ("bias", bias)):
        if t is not None and t.device != a.device:
            raise ValueError(f"{name} is on {t.device}, a on {a.device}")
    out = torch.empty(pairs.num_pairs, n, dtype=a.dtype, device=a.device)
    if pairs.num_pairs == 0:
        return out
    dot_fp32 = a.dtype == torch.float32 or (a.dtype == torch.bfloat16 and interpreting())
    grid = (pairs.block_experts.numel(), triton.cdiv(n, BLOCK_N))
    _moe_quantized_gemm_kernel[grid](
        a,
        launch["w"],
        launch["scales"],
        launch["zeros"],
        bias if bias is not None else out,
        route_weights.reshape(-1) if route_weights is not None else out,
        out,
        pairs.pair_ids,
        pairs.block_experts,
        pairs.num_pairs,
        pairs.top_k,
        n,
        k,
        launch["group_k"],
        launch["scale_rows"],
        a.stride(0),
        *launch["strides_w"],
        *launch["strides_s"],
        *launch["strides_z"],
        bias.stride(0) if bias is not None else 0,
        out.stride(0),
        FP8=launch["fp8"],
        BITS=launch["bits"],
        HAS_ZEROS=launch["has_zeros"],
        A_PER_TOKEN=per_token,
        HAS_BIAS=bias is not None,
        MUL_ROUTE=route_weights is not None,
        DOT_FP32=dot_fp32,
        DOT_PRECISION="ieee" if dot_fp32 else "tf32",
        BLOCK_M=pairs.block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
    )
    return out
