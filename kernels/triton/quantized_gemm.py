"""Weight-only quantized GEMM (W4A16 / W8A16): ``out = x @ dequant(W)^T (+ bias)``.

Semantics are those of :func:`paged_serve.kernels.reference.quantized_gemm_ref`; x is fp16, bf16
or fp32, the weight 4- or 8-bit integers with a scale (and optionally a zero point) per group
of ``group_size`` input features.

The one weight layout (GPTQ, AWQ and compressed-tensors' pack-quantized checkpoints are all
repacked into it at load)::

    qweight  [K // pack, N] int32   pack = 32 // bits values per word, packed along K,
                                    low bits first: q[k, n] = qweight[k // pack, n]
                                                              >> (k % pack * bits) & (2**bits - 1)
    scales   [num_groups, N]        x's dtype or fp32;  num_groups = K // group_size
    zeros    [num_groups, N] | None uint8/int32 integer zero points; None: symmetric, 2**(bits-1)

    w[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n],   g = k // group_size

``group_size == -1`` is one group over all of K (per-channel scales). Act-order checkpoints
(GPTQ's ``g_idx``) are not a kernel concern: the loader sorts K by ``g_idx`` once (the packed
rows, so each group is contiguous again) and the caller gathers x's columns by the same
permutation, as vLLM's exllama path does.

Algorithm and grid
------------------
Program ``(m, n, s)`` owns the output tile ``[BLOCK_M, BLOCK_N]`` and walks split ``s`` of K
(``k_per_split`` features, a multiple of ``BLOCK_K``; all of K without split-K) in steps of
``BLOCK_K = 32``. Each step loads its x tile and its weight tile, unpacked from the int32 words
(each word's row is loaded ``pack`` times, from L1) into the integers ``q - zero``, and adds
``dot(x, q - zero) * scale``: ``BLOCK_K`` divides every group size the launcher takes (32, 64,
128, ...; per-channel), so a tile lies inside one group and its scale is one row ``[BLOCK_N]``,
applied once to the tile's dot instead of to every weight. The integers are exact in fp16 and
bf16 (``|q - zero| <= 255``), so the dot's operands are x's own values and the weight's exact
integers; the only roundings are the fp32 accumulation and the scale's product. Bias is added
in fp32, then the tile is stored in x's dtype.

Split-K, for small M: decode's M = 1 has only ``N / BLOCK_N`` output tiles, fewer than a GPU's
multiprocessors on most projections, so K is split until the programs cover twice the
multiprocessors. Each split stores its fp32 tile to a workspace ``[split_k, M, N]`` and
``_sum_splits_kernel`` adds the splits in their order (then the bias): no atomics, so the result
is the same bits on every run and in every reduction order.

Launch settings are a fixed function of the shape and the multiprocessor count
(:func:`launch_settings`), not autotuned; the workspace is allocated per call (inside a CUDA
graph's capture, from the graph's pool). FP8 and int8 W8A8 weights have their own GEMM
(``kernels/triton/scaled_gemm.py``).
Under the interpreter, bf16 operands are cast to fp32 before the dot (its bf16 ``tl.dot`` is
wrong, as ``kernels/triton/paged_attention.py`` notes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import triton
import triton.language as tl
from paged_serve.kernels.triton.runtime import (
    check_device,
    interpreting,
    multiprocessor_count,
)

BLOCK_K = 32  # divides every accepted group size, so one K step lies inside one group
BLOCK_N = 64
MAX_SPLIT_K = 16  # bounds the fp32 workspace: split_k * M * N
SUPPORTED_BITS = (4, 8)
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ZERO_DTYPES = (torch.uint8, torch.int32)


@dataclass(frozen=True, slots=True)
class GemmLaunch:
    """Tiles, K splits (``split_k`` runs of ``k_per_split`` features), warps and stages."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    k_per_split: int
    num_warps: int
    num_stages: int


def launch_settings(
    m: int, n: int, k: int, num_sms: int, *, dtype: torch.dtype = torch.bfloat16
) -> GemmLaunch:
    """The launch for ``[m, k] @ [k, n]`` with x in ``dtype``: the smallest ``tl.dot`` M (16)
    for decode-sized batches, wider row tiles for prefill so each weight tile is unpacked for
    more rows; K split (M <= 64 only) until the programs cover ``2 * num_sms``, at most
    ``MAX_SPLIT_K`` ways. fp32's exact dot holds its operands in registers, so its row tiles
    stop at 64 rows over 8 warps, two stages (compiled for sm_90 with wider tiles or fewer
    warps, it spills kilobytes)."""
    num_stages = 3
    if m <= 16:
        block_m, num_warps = 16, 4
    elif dtype == torch.float32:
        block_m, num_warps, num_stages = 64, 8, 2
    elif m <= 64:
        block_m, num_warps = 64, 4
    else:
        block_m, num_warps = 128, 8
    if dtype == torch.float32:
        num_stages = 2
    steps = triton.cdiv(k, BLOCK_K)
    split_k = 1
    if m <= 64:
        tiles = triton.cdiv(m, block_m) * triton.cdiv(n, BLOCK_N)
        split_k = max(1, min(MAX_SPLIT_K, steps, triton.cdiv(2 * num_sms, tiles)))
    steps_per_split = triton.cdiv(steps, split_k)
    return GemmLaunch(
        block_m=block_m,
        block_n=BLOCK_N,
        block_k=BLOCK_K,
        split_k=triton.cdiv(steps, steps_per_split),  # no split left empty
        k_per_split=steps_per_split * BLOCK_K,
        num_warps=num_warps,
        num_stages=num_stages,
    )


@triton.jit
def _load_dequantized_tile(
    qweight_ptr,
    zeros_ptr,
    offs_k,
    offs_n,
    k_mask,
    n_mask,
    group,
    stride_qk,
    stride_zg,
    BITS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
):
    """The weight tile ``[BLOCK_K, BLOCK_N]`` as fp32 integers ``q - zero`` (0 where masked)."""
    pack: tl.constexpr = 32 // BITS
    words = tl.load(
        qweight_ptr + (offs_k // pack)[:, None] * stride_qk + offs_n[None, :],
        mask=k_mask[:, None] & n_mask[None, :],
        other=0,
    )
    shifts = ((offs_k % pack) * BITS).to(tl.int32)
    q = (words >> shifts[:, None]) & ((1 << BITS) - 1)  # the mask undoes the sign extension
    if HAS_ZEROS:
        zero = tl.load(zeros_ptr + group * stride_zg + offs_n, mask=n_mask, other=0).to(tl.int32)
    else:
        zero = tl.full(offs_n.shape, 1 << (BITS - 1), tl.int32)
    w = (q - zero[None, :]).to(tl.float32)
    return tl.where(k_mask[:, None] & n_mask[None, :], w, 0.0)


@triton.jit
def _quantized_gemm_kernel(
    x_ptr,
    qweight_ptr,
    scales_ptr,
    zeros_ptr,
    bias_ptr,
    out_ptr,
    partial_ptr,
    M,
    N,
    K,
    k_per_split,
    group_size,
    stride_xm,
    stride_qk,
    stride_sg,
    stride_zg,
    stride_om,
    BITS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = pid_s * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
        k_mask = offs_k < k_end
        group = (k0 // group_size).to(tl.int64)  # the whole tile: BLOCK_K divides group_size
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        w = _load_dequantized_tile(
            qweight_ptr,
            zeros_ptr,
            offs_k,
            offs_n,
            k_mask,
            n_mask,
            group,
            stride_qk,
            stride_zg,
            BITS=BITS,
            HAS_ZEROS=HAS_ZEROS,
        )
        if DOT_FP32:
            x = x.to(tl.float32)
        else:
            w = w.to(x.dtype)  # exact: integers of at most 8 bits
        scale = tl.load(scales_ptr + group * stride_sg + offs_n, mask=n_mask, other=0.0)
        partial = tl.dot(x, w, input_precision=DOT_PRECISION)
        acc += partial * scale.to(tl.float32)[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT:  # the split's fp32 tile; _sum_splits_kernel adds the bias
        split_base = partial_ptr + pid_s.to(tl.int64) * M * N
        tl.store(split_base + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out_offs = offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_splits_kernel(
    partial_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    stride_om,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Row ``m``'s columns of block ``n``: the splits added in order, the bias, x's dtype."""
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for s in range(SPLIT_K):  # a fixed order: the same bits on every run
        acc += tl.load(partial_ptr + (s * M + row) * N + offs_n, mask=n_mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


def _check_inputs(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bias: torch.Tensor | None,
    out: torch.Tensor | None,
    bits: int,
    group_size: int,
) -> int:
    """Raise ``ValueError`` naming the offending values; return the effective group size."""
    check_device(x.device)
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    if x.dim() != 2 or x.dtype not in ACTIVATION_DTYPES or x.stride(-1) != 1:
        raise ValueError(
            f"x must be [M, K] {ACTIVATION_DTYPES} with contiguous rows, "
            f"got {tuple(x.shape)} {x.dtype} strides {x.stride()}"
        )
    m, k = x.shape
    pack = 32 // bits
    if qweight.dim() != 2 or qweight.dtype != torch.int32 or not qweight.is_contiguous():
        raise ValueError(
            f"qweight must be a contiguous [K // {pack}, N] int32, "
            f"got {tuple(qweight.shape)} {qweight.dtype}"
        )
    if k % pack or qweight.shape[0] != k // pack:
        raise ValueError(
            f"qweight has {qweight.shape[0]} rows of {pack} {bits}-bit values; x has K={k}"
        )
    n = qweight.shape[1]
    if group_size == -1:
        group_size = k
    elif group_size <= 0 or group_size % BLOCK_K or k % group_size:
        raise ValueError(
            f"group_size must be -1 or a multiple of {BLOCK_K} dividing K={k}, got {group_size}"
        )
    num_groups = k // group_size
    if scales.shape != (num_groups, n) or not scales.is_contiguous():
        raise ValueError(
            f"scales must be a contiguous [{num_groups}, {n}], got {tuple(scales.shape)}"
        )
    if scales.dtype not in (x.dtype, torch.float32):
        raise ValueError(f"scales must be {x.dtype} or torch.float32, got {scales.dtype}")
    if zeros is not None:
        if zeros.shape != (num_groups, n) or not zeros.is_contiguous():
            raise ValueError(
                f"zeros must be a contiguous [{num_groups}, {n}], got {tuple(zeros.shape)}"
            )
        if zeros.dtype not in ZERO_DTYPES:
            raise ValueError(f"zeros must be one of {ZERO_DTYPES}, got {zeros.dtype}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{n}], got {tuple(bias.shape)}")
    if out is not None and (out.shape != (m, n) or out.dtype != x.dtype or out.stride(-1) != 1):
        raise ValueError(
            f"out must be [{m}, {n}] {x.dtype} with contiguous rows, "
            f"got {tuple(out.shape)} {out.dtype} strides {out.stride()}"
        )
    for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    return group_size


def quantized_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None = None,
    *,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ dequant(W)^T (+ bias)``: ``[M, N]`` in x's dtype (written into ``out`` if given).

    x: ``[M, K]`` fp16/bf16/fp32, rows contiguous; qweight: ``[K // (32 // bits), N]`` int32;
    scales: ``[num_groups, N]`` in x's dtype or fp32; zeros: ``[num_groups, N]`` uint8/int32 or
    None (symmetric); bias: ``[N]``; ``bits`` 4 or 8; ``group_size`` a multiple of ``BLOCK_K``
    (32) dividing K, or -1 (one group). The layout is the module docstring's.
    """
    group_size = _check_inputs(x, qweight, scales, zeros, bias, out, bits, group_size)
    m, k = x.shape
    n = qweight.shape[1]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    launch = launch_settings(m, n, k, multiprocessor_count(x.device), dtype=x.dtype)
    split = launch.split_k > 1
    partial = (
        torch.empty(launch.split_k, m, n, dtype=torch.float32, device=x.device) if split else out
    )
    dot_fp32 = x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and interpreting())
    grid = (triton.cdiv(m, launch.block_m), triton.cdiv(n, launch.block_n), launch.split_k)
    _quantized_gemm_kernel[grid](
        x,
        qweight,
        scales,
        zeros if zeros is not None else qweight,
        bias if bias is not None else scales,
        out,
        partial,
        m,
        n,
        k,
        launch.k_per_split,
        group_size,
        x.stride(0),
        qweight.stride(0),
        scales.stride(0),
        zeros.stride(0) if zeros is not None else 0,
        out.stride(0),
        BITS=bits,
        HAS_ZEROS=zeros is not None,
        HAS_BIAS=bias is not None,
        SPLIT=split,
        DOT_FP32=dot_fp32,
        DOT_PRECISION="ieee" if dot_fp32 else "tf32",
        BLOCK_M=launch.block_m,
        BLOCK_N=launch.block_n,
        BLOCK_K=launch.block_k,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    if split:
        _sum_splits_kernel[(m, triton.cdiv(n, BLOCK_N))](
            partial,
            bias if bias is not None else partial,
            out,
            m,
            n,
            out.stride(0),
            SPLIT_K=launch.split_k,
            HAS_BIAS=bias is not None,
            BLOCK_N=BLOCK_N,
        )
    return out
