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
Program ``(m, n)`` owns the output tile ``[BLOCK_M, BLOCK_N]`` and walks K in steps of
``BLOCK_K = 32``. Each step loads its x tile and its weight tile, unpacked from the int32 words
(each word's row is loaded ``pack`` times, from L1) into the integers ``q - zero``, and adds
``dot(x, q - zero) * scale``: ``BLOCK_K`` divides every group size the launcher takes (32, 64,
128, ...; per-channel), so a tile lies inside one group and its scale is one row ``[BLOCK_N]``,
applied once to the tile's dot instead of to every weight. The integers are exact in fp16 and
bf16 (``|q - zero| <= 255``), so the dot's operands are x's own values and the weight's exact
integers; the only roundings are the fp32 accumulation and the scale's product. Bias is added
in fp32, then the tile is stored in x's dtype.

Launch settings are a fixed function of M (:func:`launch_settings`), not autotuned. Not done
yet: split-K for small M (decode's M = 1 uses only ``N / BLOCK_N`` programs), FP8 weights, and
wiring into the engine. Under the interpreter, bf16 operands are cast to fp32 before the dot
(its bf16 ``tl.dot`` is wrong, as ``kernels/triton/paged_attention.py`` notes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import triton
import triton.language as tl
from paged_serve.kernels.triton.runtime import check_device, interpreting

BLOCK_K = 32  # divides every accepted group size, so one K step lies inside one group
SUPPORTED_BITS = (4, 8)
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ZERO_DTYPES = (torch.uint8, torch.int32)


@dataclass(frozen=True, slots=True)
class GemmLaunch:
    """Tile sizes and warps of one launch."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def launch_settings(m: int) -> GemmLaunch:
    """The launch for ``m`` rows: the smallest ``tl.dot`` M (16) for decode-sized batches, wider
    row tiles for prefill so each weight tile is unpacked for more rows."""
    if m <= 16:
        return GemmLaunch(block_m=16, block_n=64, block_k=BLOCK_K, num_warps=4, num_stages=3)
    if m <= 64:
        return GemmLaunch(block_m=64, block_n=64, block_k=BLOCK_K, num_warps=4, num_stages=3)
    return GemmLaunch(block_m=128, block_n=64, block_k=BLOCK_K, num_warps=8, num_stages=3)


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
    M,
    N,
    K,
    group_size,
    stride_xm,
    stride_qk,
    stride_sg,
    stride_zg,
    stride_om,
    BITS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
        k_mask = offs_k < K
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
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


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
    launch = launch_settings(m)
    dot_fp32 = x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and interpreting())
    grid = (triton.cdiv(m, launch.block_m), triton.cdiv(n, launch.block_n))
    _quantized_gemm_kernel[grid](
        x,
        qweight,
        scales,
        zeros if zeros is not None else qweight,
        bias if bias is not None else scales,
        out,
        m,
        n,
        k,
        group_size,
        x.stride(0),
        qweight.stride(0),
        scales.stride(0),
        zeros.stride(0) if zeros is not None else 0,
        out.stride(0),
        BITS=bits,
        HAS_ZEROS=zeros is not None,
        HAS_BIAS=bias is not None,
        DOT_FP32=dot_fp32,
        DOT_PRECISION="ieee" if dot_fp32 else "tf32",
        BLOCK_M=launch.block_m,
        BLOCK_N=launch.block_n,
        BLOCK_K=launch.block_k,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    return out
