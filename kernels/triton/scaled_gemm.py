"""FP8 and int8 W8A8 GEMM for checkpoint weights: ``out = dq(quant(x)) @ dq(W)^T (+ bias)``.

Semantics are those of :func:`paged_serve.kernels.reference.fp8_gemm_ref` and
:func:`~paged_serve.kernels.reference.int8_gemm_ref`: the activations are quantized at run time
to the weight's type, then multiplied with the stored weight on the GPU's 8-bit tensor cores.

Layouts (``engine/quant/weights.py``'s ``ScaledFp8`` and ``ScaledInt8``)::

    weight  [N, K] float8_e4m3fn | int8 (symmetric)
    scale   fp32   fp8: [] or [1] (per tensor), [N] (per output channel), or
                        [ceil(N / bn), ceil(K / bk)] with block_size = (bn, bk) ("fine-grained
                        FP8": DeepSeek-V3, Qwen3; 128 x 128), N and K need not be multiples
                   int8: [N]
    w[n, k] = weight[n, k] * scale[n // bn, k // bk]   (block; channel: scale[n]; tensor: scale)

Activation quantization (``_quantize_rows_kernel``, one program per row and group of inputs):
a group is ``bk`` inputs of a row with block scales (the last one may be shorter), else the
whole row (read twice, in steps of up to 4096 inputs); ``s = max(amax, 1e-10) / QMAX`` (QMAX
448 for e4m3, 127 for int8; the floor keeps an all-zero group finite, as vLLM's
``per_token_group_quant_fp8`` does) and ``code = round(clamp(x / s, -QMAX, QMAX))``, rounding
to nearest, ties to even, for both types. The
kernel divides with ``div_rn`` (IEEE, as torch) and rounds in fp32 itself (``_round_to_e4m3``,
``_round_to_int``) before a cast that is then exact: the interpreter's fp32 -> fp8 conversion
does not round to nearest even, so one code path gives the reference's codes on both.
Scales are ``[M, num_groups]`` fp32.

GEMM (``_scaled_gemm_kernel``, grid ``(ceil(M / BLOCK_M), ceil(N / BLOCK_N))``): program
``(m, n)`` owns the output tile and walks K in steps of ``BLOCK_K``, loading the activation
codes ``[BLOCK_M, BLOCK_K]`` and the weight tile ``[BLOCK_K, BLOCK_N]`` (the stored ``[N, K]``
rows read K-major, as the 8-bit MMAs want both operands). With block scales ``BLOCK_K`` divides
``bk``, so a step lies in one group and adds ``dot * a_scale[m] * w_scale[n // bn]``; with
channel or tensor scales the dot accumulates over all of K (fp32 for fp8, int32 for int8: exact)
and the product of the two scales is applied once at the end. Bias is added in fp32, then the
tile is stored in x's dtype. No split-K and no atomics: the same bits on every run.

On a GPU the dot takes the 8-bit operands (fp8 needs sm_89 or newer, int8 sm_80); under the
interpreter (numpy) they are cast to fp32 first, where the codes are exact: fp8 products carry
8 significant bits, and an int8 step's sum (at most ``BLOCK_K * 127^2 < 2^24``) is an exact
integer, converted back to int32 before it is accumulated.

Launch settings are a fixed function of M and ``bk`` (:func:`launch_settings`), not autotuned.
The codes and their scales are allocated per call (inside a CUDA graph's capture, from its pool).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import triton
import triton.language as tl
from paged_serve.kernels.triton.runtime import check_device, interpreting

FP8_MAX = 448.0  # largest finite e4m3fn
INT8_MAX = 127.0
AMAX_FLOOR = 1e-10
# Inputs a quantization program reads per step: a per-token row of 14336 (Llama's down_proj)
# in 4 steps per pass, so decode's single program is not a chain of dependent small loads.
QUANT_CHUNK = 4096
BLOCK_K_CHOICES = (128, 64, 32)  # 32: the smallest K of an 8-bit MMA
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_CAPABILITY = (8, 9)
INT8_CAPABILITY = (8, 0)


@dataclass(frozen=True, slots=True)
class ScaledGemmLaunch:
    """Output tile ``block_m x block_n``, K step ``block_k``, warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def launch_settings(m: int, *, group_k: int | None) -> ScaledGemmLaunch:
    """The launch for ``m`` rows; ``group_k`` is the weight's block ``bk`` (None: channel or
    tensor scales). Decode-sized M takes the smallest MMA M (16) and 32-wide column tiles, so a
    4096-wide projection still gives 128 programs; prefill 128-row tiles over 8 warps, 128
    columns wide, or 64 with block scales (each step's scaled partial product beside the
    accumulator: compiled for sm_90, 128 x 128 spilled 36 bytes at 255 registers, 128 x 64 takes
    174). The K step is the largest of 128, 64, 32 dividing ``bk`` (one scale group per step)."""
    block_k = 128
    if group_k is not None:
        block_k = next(b for b in BLOCK_K_CHOICES if group_k % b == 0)
    if m <= 16:
        return ScaledGemmLaunch(16, 32, block_k, num_warps=4, num_stages=4)
    if m <= 64:
        return ScaledGemmLaunch(64, 64, block_k, num_warps=4, num_stages=3)
    return ScaledGemmLaunch(128, 128 if group_k is None else 64, block_k, num_warps=8, num_stages=3)


@triton.jit
def _round_to_e4m3(y):
    """``y`` (fp32, ``|y| <= 448``) rounded to the nearest e4m3 value, ties to even, in fp32.

    e4m3 keeps 3 fraction bits, so the spacing at ``y`` is ``2^(e - 3)`` with ``e`` its binade
    (at least -6: the subnormals share the smallest normal binade's spacing). Adding and taking
    away ``c = 1.5 * 2^(e + 20)``, whose fp32 ulp is that spacing, rounds ``|y|`` to it (IEEE's
    round to nearest even; ``|y| < 2^(e + 1)`` keeps the sum in ``c``'s binade). The sign is
    put back by its bit, so what rounds to zero keeps it (-0), as the hardware cast does."""
    bits = y.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    magic = (((exponent + 20 + 127) << 23) | 0x400000).to(tl.float32, bitcast=True)
    magnitude = (tl.abs(y) + magic) - magic
    sign = bits & -0x80000000
    return (magnitude.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _round_to_int(y):
    """``y`` (fp32, ``|y| <= 2^22``) rounded to the nearest integer, ties to even, in fp32:
    ``1.5 * 2^23`` has an fp32 ulp of 1."""
    return (y + 12582912.0) - 12582912.0


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    K,
    group_size,
    num_groups,
    stride_xm,
    stride_cm,
    QMAX: tl.constexpr,
    INT8: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Row ``m``'s group ``g``: its scale ``max(amax, floor) / QMAX`` and its codes."""
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1).to(tl.int64)
    start = group * group_size
    end = tl.minimum(K, start + group_size)
    amax = tl.zeros([CHUNK], dtype=tl.float32)
    for k0 in range(start, end, CHUNK):  # pass 1: the group's largest magnitude
        offs = k0 + tl.arange(0, CHUNK)
        x = tl.load(x_ptr + row * stride_xm + offs, mask=offs < end, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), 1e-10), QMAX)
    tl.store(scales_ptr + row * num_groups + group, scale)
    for k0 in range(start, end, CHUNK):  # pass 2: the codes (re-read from L1/L2)
        offs = k0 + tl.arange(0, CHUNK)
        mask = offs < end
        x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -QMAX), QMAX)
        if INT8:
            code = _round_to_int(y).to(tl.int8)
        else:
            code = _round_to_e4m3(y).to(tl.float8e4nv)  # exact: y is an e4m3 value already
        tl.store(codes_ptr + row * stride_cm + offs, code, mask=mask)


@triton.jit
def _load_step(
    a_ptr,
    w_ptr,
    offs_m,
    offs_n,
    offs_k,
    m_mask,
    n_mask,
    K,
    stride_am,
    stride_wn,
):
    """The activation codes ``[BLOCK_M, BLOCK_K]`` and the weight tile ``[BLOCK_K, BLOCK_N]``
    (0 where masked)."""
    k_mask = offs_k < K
    a = tl.load(
        a_ptr + offs_m[:, None] * stride_am + offs_k[None, :],
        mask=m_mask[:, None] & k_mask[None, :],
        other=0.0,
    )
    w = tl.load(
        w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None],
        mask=k_mask[:, None] & n_mask[None, :],
        other=0.0,
    )
    return a, w


@triton.jit
def _step_dot(a, w, INT8: tl.constexpr, DOT_FP32: tl.constexpr):
    """One K step's product: int32 for int8 codes, else fp32."""
    if DOT_FP32:  # the interpreter: exact codes in fp32 (see the module docstring)
        partial = tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        if INT8:
            partial = partial.to(tl.int32)
    elif INT8:
        partial = tl.dot(a, w, out_dtype=tl.int32)
    else:
        partial = tl.dot(a, w)
    return partial


@triton.jit
def _scaled_gemm_kernel(
    a_ptr,
    a_scales_ptr,
    w_ptr,
    w_scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    group_k,
    num_groups,
    block_n_w,
    stride_am,
    stride_wn,
    stride_ws,
    stride_om,
    INT8: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr,
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
    if BLOCK_SCALES:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        w_scale_rows = w_scale_ptr + (offs_n // block_n_w) * stride_ws
    elif INT8:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
        a, w = _load_step(
            a_ptr, w_ptr, offs_m, offs_n, offs_k, m_mask, n_mask, K, stride_am, stride_wn
        )
        partial = _step_dot(a, w, INT8=INT8, DOT_FP32=DOT_FP32)
        if BLOCK_SCALES:  # the step lies in one group: BLOCK_K divides bk
            group = k0 // group_k
            a_scale = tl.load(a_scales_ptr + offs_m * num_groups + group, mask=m_mask, other=0.0)
            w_scale = tl.load(w_scale_rows + group, mask=n_mask, other=0.0)
            acc += partial * a_scale[:, None] * w_scale[None, :]
        else:
            acc += partial
    if BLOCK_SCALES:
        out = acc
    else:  # one activation scale per row, one weight scale per column (stride 0: the tensor's)
        a_scale = tl.load(a_scales_ptr + offs_m, mask=m_mask, other=0.0)
        w_scale = tl.load(w_scale_ptr + offs_n * stride_ws, mask=n_mask, other=0.0)
        out = acc.to(tl.float32) * a_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_offs = offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(
        out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :]
    )


def _check_rows(rows: torch.Tensor) -> None:
    check_device(rows.device)
    if rows.dim() != 2 or rows.dtype not in ACTIVATION_DTYPES or rows.stride(-1) != 1:
        raise ValueError(
            f"rows must be [M, K] {ACTIVATION_DTYPES} with contiguous rows, "
            f"got {tuple(rows.shape)} {rows.dtype} strides {rows.stride()}"
        )


def _check_capability(device: torch.device, needed: tuple[int, int], what: str) -> None:
    """Refuse a GPU without the 8-bit MMA ``what`` needs (the interpreter has none to lack)."""
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < needed:
        raise ValueError(
            f"{what} needs a GPU of compute capability {needed[0]}.{needed[1]} or newer, "
            f"{device} is {capability[0]}.{capability[1]}"
        )


def _quantize_rows(
    rows: torch.Tensor, *, group_size: int | None, code_dtype: torch.dtype, qmax: float
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_rows(rows)
    m, k = rows.shape
    group = k if group_size is None else group_size
    if group <= 0:
        raise ValueError(f"group_size must be positive or None, got {group_size}")
    num_groups = triton.cdiv(k, group) if k else 1
    codes = torch.empty(m, k, dtype=code_dtype, device=rows.device)
    scales = torch.empty(m, num_groups, dtype=torch.float32, device=rows.device)
    if m == 0 or k == 0:
        return codes, scales.fill_(AMAX_FLOOR / qmax)
    chunk = min(QUANT_CHUNK, triton.next_power_of_2(group))
    _quantize_rows_kernel[(m, num_groups)](
        rows,
        codes,
        scales,
        k,
        group,
        num_groups,
        rows.stride(0),
        codes.stride(0),
        QMAX=qmax,
        INT8=code_dtype == torch.int8,
        CHUNK=chunk,
        num_warps=8 if chunk >= 2048 else 4,
    )
    return codes, scales


def quantize_fp8_rows(
    rows: torch.Tensor, *, group_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [M, K] float8_e4m3fn, scales [M, num_groups] fp32)`` of ``rows [M, K]``: one
    scale per row (``group_size`` None) or per row and ``group_size`` inputs (the last group may
    be shorter); ``rows ~= codes * scales`` per group. The module docstring has the recipe."""
    return _quantize_rows(rows, group_size=group_size, code_dtype=torch.float8_e4m3fn, qmax=FP8_MAX)


def quantize_int8_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [M, K] int8, scales [M, 1] fp32)``: one scale per row, ``amax / 127``,
    codes rounded to nearest, ties to even."""
    return _quantize_rows(rows, group_size=None, code_dtype=torch.int8, qmax=INT8_MAX)


def _check_weight(
    rows: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    weight_dtype: torch.dtype,
) -> tuple[int, int, int]:
    """Raise ``ValueError`` naming the offending values; return ``(M, N, K)``."""
    _check_rows(rows)
    if weight.dtype != weight_dtype or weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(
            f"weight must be a contiguous [N, K] {weight_dtype}, "
            f"got {tuple(weight.shape)} {weight.dtype}"
        )
    m, k = rows.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"weight has K={weight.shape[1]} inputs; rows have K={k}")
    if scale.dtype != torch.float32:
        raise ValueError(f"scale must be torch.float32, got {scale.dtype}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{n}], got {tuple(bias.shape)}")
    for name, t in (("weight", weight), ("scale", scale), ("bias", bias)):
        if t is not None and t.device != rows.device:
            raise ValueError(f"{name} is on {t.device}, rows on {rows.device}")
    return m, n, k


def _launch_gemm(
    codes: torch.Tensor,
    a_scales: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    *,
    block_size: tuple[int, int] | None,
    stride_ws: int,
) -> torch.Tensor:
    m, k = codes.shape
    n = weight.shape[0]
    if m == 0 or n == 0:
        return out
    launch = launch_settings(m, group_k=None if block_size is None else block_size[1])
    grid = (triton.cdiv(m, launch.block_m), triton.cdiv(n, launch.block_n))
    _scaled_gemm_kernel[grid](
        codes,
        a_scales,
        weight,
        w_scale,
        bias if bias is not None else w_scale,
        out,
        m,
        n,
        k,
        k if block_size is None else block_size[1],
        a_scales.shape[1],
        1 if block_size is None else block_size[0],
        codes.stride(0),
        weight.stride(0),
        stride_ws,
        out.stride(0),
        INT8=weight.dtype == torch.int8,
        BLOCK_SCALES=block_size is not None,
        HAS_BIAS=bias is not None,
        DOT_FP32=interpreting(),
        BLOCK_M=launch.block_m,
        BLOCK_N=launch.block_n,
        BLOCK_K=launch.block_k,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    return out


def fp8_gemm(
    rows: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    *,
    block_size: tuple[int, int] | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``dq(quant(rows)) @ dq(weight)^T (+ bias)``: ``[M, N]`` in rows' dtype.

    rows: ``[M, K]`` fp32/bf16/fp16, rows contiguous; weight: ``[N, K]`` float8_e4m3fn;
    scale: fp32 ``[]``/``[1]`` (tensor) or ``[N]`` (channel) with ``block_size`` None, else
    ``[ceil(N / bn), ceil(K / bk)]`` for ``block_size = (bn, bk)``, ``bk`` a multiple of 32;
    bias: ``[N]``. Activations are quantized to e4m3 per row and group of ``bk`` inputs with
    block scales, per row without (module docstring). Needs sm_89 or newer on a GPU.
    """
    m, n, k = _check_weight(rows, weight, scale, bias, torch.float8_e4m3fn)
    _check_capability(rows.device, FP8_CAPABILITY, "fp8_gemm (e4m3 tensor cores)")
    if block_size is None:
        if scale.shape not in ((), (1,), (n,)):
            raise ValueError(
                f"scale must be [] or [1] (per tensor) or [{n}] (per channel) without "
                f"block_size, got {tuple(scale.shape)}"
            )
        stride_ws = 1 if scale.shape == (n,) and n > 1 else 0
        group_size = None
    else:
        bn, bk = block_size
        if bn <= 0 or bk <= 0 or bk % BLOCK_K_CHOICES[-1]:
            raise ValueError(
                f"block_size must be (bn, bk) with bn > 0 and bk a positive multiple of "
                f"{BLOCK_K_CHOICES[-1]}, got {block_size}"
            )
        want = (triton.cdiv(n, bn), triton.cdiv(k, bk))
        if scale.shape != want or not scale.is_contiguous():
            raise ValueError(
                f"scale must be a contiguous {list(want)} for block_size {tuple(block_size)} "
                f"and [N, K] = [{n}, {k}], got {tuple(scale.shape)}"
            )
        stride_ws = scale.stride(0)
        group_size = bk
    codes, a_scales = quantize_fp8_rows(rows, group_size=group_size)
    out = torch.empty(m, n, dtype=rows.dtype, device=rows.device)
    return _launch_gemm(
        codes,
        a_scales,
        weight,
        scale,
        bias,
        out,
        block_size=None if block_size is None else tuple(block_size),
        stride_ws=stride_ws,
    )


def int8_gemm(
    rows: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``dq(quant(rows)) @ dq(weight)^T (+ bias)``: ``[M, N]`` in rows' dtype.

    rows: ``[M, K]`` fp32/bf16/fp16, rows contiguous; weight: ``[N, K]`` int8 (symmetric);
    scale: ``[N]`` fp32; bias: ``[N]``. Activations are quantized to int8 per row (``amax /
    127``, ties to even); the product accumulates in int32 on a GPU (sm_80 or newer).
    """
    m, n, _ = _check_weight(rows, weight, scale, bias, torch.int8)
    _check_capability(rows.device, INT8_CAPABILITY, "int8_gemm (int8 tensor cores)")
    if scale.shape != (n,) or not scale.is_contiguous():
        raise ValueError(
            f"scale must be a contiguous [{n}] (per channel), got {tuple(scale.shape)}"
        )
    codes, a_scales = quantize_int8_rows(rows)
    out = torch.empty(m, n, dtype=rows.dtype, device=rows.device)
    return _launch_gemm(codes, a_scales, weight, scale, bias, out, block_size=None, stride_ws=1)
