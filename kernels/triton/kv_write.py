"""KV-cache write: scatter the step's new keys and values into their cache slots.

Semantics are exactly those of :func:`paged_serve.kernels.reference.write_kv_ref`: token ``t``'s
``[Hkv, D]`` key and value go to flat slot ``slot_mapping[t]`` (``block * block_size + offset``)
of ``k_cache`` / ``v_cache`` ``[num_blocks, block_size, Hkv, D]``; slot ``-1`` means "skip"
(padding or a token whose KV is already cached). Pure data movement, bit-exact.

Grid: ``(num_tokens, cdiv(Hkv, BLOCK_H))``. Each program reads its token's slot once, returns
early for ``-1``, and copies a ``[BLOCK_H, BLOCK_D]`` tile (``BLOCK_D`` = head_dim rounded up to
a power of two, masked; ``BLOCK_H * BLOCK_D`` <= 4096) of both the key and the value. Slot and
token offsets are int64, so caches beyond 2^31 elements are addressed correctly. A latent cache
(``write_latent``: one ``[C]`` entry per token, multi-head latent attention) is written by the
same kernel with one head and no value side.

Quantized caches (``k_scale``, ``v_scale`` given, ``kernels/interface.py``'s ``WriteKv``; a
latent cache's ``latent_scale``, one scale per token, ``WriteLatent``): the caches hold int8 /
float8_e4m3fn / float8_e5m2 codes, and the same program quantizes its tile in fp32 before
storing it: per head (a row of the tile), ``amax`` over the D lanes, ``scale = amax / QMAX``
(1.0 where ``amax == 0``), ``x / scale`` clamped to ``[-QMAX, QMAX]`` and rounded to the code
grid (nearest, ties to even), then the codes and the ``[BLOCK_H]`` scales. Both
divisions are ``div_rn`` (IEEE, as torch's), and the rounding is done in fp32 (``_round_to_int``,
``_round_to_fp8``) so the final cast is exact: the interpreter's fp32 -> fp8 cast does not round
to nearest even, and this way the interpreter and a GPU store ``quantize_kv_ref``'s codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import triton
import triton.language as tl
from paged_serve.kernels.triton.runtime import check_device

_MAX_TILE = 4096


@dataclass(frozen=True, slots=True)
class KvCodeFormat:
    """How a quantized cache's codes are made: ``qmax`` (the largest code magnitude), and for
    fp8 the fraction bits and the smallest normal exponent (subnormals share its spacing)."""

    qmax: float
    is_int: bool
    mantissa_bits: int = 0
    min_exponent: int = 0


KV_CODE_FORMATS = {
    torch.int8: KvCodeFormat(127.0, True),
    torch.float8_e4m3fn: KvCodeFormat(448.0, False, 3, -6),
    torch.float8_e5m2: KvCodeFormat(57344.0, False, 2, -14),
}


@triton.jit
def _round_to_int(y):
    """``y`` (fp32, ``|y| <= 2^22``) rounded to the nearest integer, ties to even, in fp32:
    ``1.5 * 2^23`` has an fp32 ulp of 1, so adding and taking it away rounds."""
    return (y + 12582912.0) - 12582912.0


@triton.jit
def _round_to_fp8(y, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr):
    """``y`` (fp32, within the format's range) rounded to the nearest value of an fp8 format
    with ``MANTISSA`` fraction bits, ties to even, in fp32. At binade ``e`` (at least
    ``MIN_EXP``) the spacing is ``2^(e - MANTISSA)``, the fp32 ulp of ``c = 1.5 * 2^(e + 23 -
    MANTISSA)``: ``(|y| + c) - c`` rounds to it. The sign goes back by its bit (-0 stays -0)."""
    bits = y.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, MIN_EXP)
    magic = (((exponent + 150 - MANTISSA) << 23) | 0x400000).to(tl.float32, bitcast=True)
    magnitude = (tl.abs(y) + magic) - magic
    return (magnitude.to(tl.int32, bitcast=True) | (bits & -0x80000000)).to(
        tl.float32, bitcast=True
    )


@triton.jit
def _quantize_heads(
    x,
    QMAX: tl.constexpr,
    INT_CODES: tl.constexpr,
    MANTISSA: tl.constexpr,
    MIN_EXP: tl.constexpr,
):
    """``(codes, scale)`` of ``x [BLOCK_H, BLOCK_D]`` fp32 (padded lanes 0), one scale per head
    (row): ``amax / QMAX`` (1.0 for an all-zero head), the codes on the code grid in fp32."""
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.where(amax > 0.0, tl.math.div_rn(amax, QMAX), 1.0)
    y = tl.math.div_rn(x, scale[:, None])
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if INT_CODES:
        codes = _round_to_int(y)
    else:
        codes = _round_to_fp8(y, MANTISSA, MIN_EXP)
    return codes, scale


@triton.jit
def _store_side(
    x,
    cache_ptr,
    cache_off,
    scale_ptr,
    scale_off,
    mask,
    h_mask,
    QUANT: tl.constexpr,
    QMAX: tl.constexpr,
    INT_CODES: tl.constexpr,
    MANTISSA: tl.constexpr,
    MIN_EXP: tl.constexpr,
):
    """Store one side's ``[BLOCK_H, BLOCK_D]`` tile: as is, or (``QUANT``) as codes and scales."""
    if QUANT:
        x = tl.where(mask, x.to(tl.float32), 0.0)  # masked lanes were not loaded
        codes, scale = _quantize_heads(x, QMAX, INT_CODES, MANTISSA, MIN_EXP)
        tl.store(cache_ptr + cache_off, codes.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + scale_off, scale, mask=h_mask)
    else:
        tl.store(cache_ptr + cache_off, x, mask=mask)


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    num_kv_heads,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_slot,
    stride_cache_head,
    k_scale_ptr,
    v_scale_ptr,
    stride_scale_slot,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WRITE_VALUE: tl.constexpr = True,
    QUANT: tl.constexpr = False,
    QMAX: tl.constexpr = 0.0,
    INT_CODES: tl.constexpr = False,
    MANTISSA: tl.constexpr = 0,
    MIN_EXP: tl.constexpr = 0,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < num_kv_heads
    mask = h_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    cache_off = slot * stride_cache_slot + offs_h[:, None] * stride_cache_head + offs_d[None, :]
    scale_off = slot * stride_scale_slot + offs_h  # (QUANT only) scales [.., Hkv], contiguous

    k = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask)
    _store_side(
        k, k_cache_ptr, cache_off, k_scale_ptr, scale_off, mask, h_mask,
        QUANT, QMAX, INT_CODES, MANTISSA, MIN_EXP,
    )  # fmt: skip
    if WRITE_VALUE:
        v = tl.load(
            value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask
        )
        _store_side(
            v, v_cache_ptr, cache_off, v_scale_ptr, scale_off, mask, h_mask,
            QUANT, QMAX, INT_CODES, MANTISSA, MIN_EXP,
        )  # fmt: skip


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into the caches at ``slot_mapping [T]`` (int64).

    k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, contiguous, same dtype as key/value.
    Slots must be ``-1`` or ``< num_blocks * block_size`` (not checked: that would need a sync).
    In place; bit-exact. With ``k_scale``, ``v_scale`` (``[num_blocks, block_size, Hkv]`` fp32,
    contiguous; both or neither) the caches are int8 / float8_e4m3fn / float8_e5m2 codes (both
    the same) and each token's heads are quantized as ``quantize_kv_ref`` does.
    """
    # key, value: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D]; slot_mapping: [T]
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(
            f"key and value must both be [T, Hkv, D], got {tuple(key.shape)} and "
            f"{tuple(value.shape)}"
        )
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, Hkv, D], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_tokens, num_kv_heads, head_dim = key.shape
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"cache [Hkv, D] = {tuple(k_cache.shape[2:])} does not match key "
            f"[Hkv, D] = {(num_kv_heads, head_dim)}"
        )
    code_format = _check_quantized(key, value, k_cache, v_cache, k_scale, v_scale)
    if code_format is None and len({key.dtype, value.dtype, k_cache.dtype, v_cache.dtype}) != 1:
        raise ValueError(
            f"key/value/k_cache/v_cache dtypes must match, got {key.dtype}, {value.dtype}, "
            f"{k_cache.dtype}, {v_cache.dtype}"
        )
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"slot_mapping must be int64 [{num_tokens}], got {slot_mapping.dtype} "
            f"{tuple(slot_mapping.shape)}"
        )
    device = key.device
    for name, t in (
        ("value", value),
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("slot_mapping", slot_mapping),
    ):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, key is on {device}")
    check_device(device)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError(
            f"key/value last dim must be contiguous, got strides {key.stride()}, {value.stride()}"
        )
    if not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be contiguous")
    if num_tokens == 0:
        return

    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, _MAX_TILE // block_d))
    quant = {}
    if code_format is not None:
        quant = dict(
            QUANT=True,
            QMAX=code_format.qmax,
            INT_CODES=code_format.is_int,
            MANTISSA=code_format.mantissa_bits,
            MIN_EXP=code_format.min_exponent,
        )
    _write_kv_kernel[(num_tokens, triton.cdiv(num_kv_heads, block_h))](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        num_kv_heads,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache if k_scale is None else k_scale,  # unused without QUANT
        v_cache if v_scale is None else v_scale,
        0 if k_scale is None else k_scale.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        **quant,
    )


def _check_quantized(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> KvCodeFormat | None:
    """The code format of a quantized write (None: not quantized); ValueError for scales
    without the other, of another shape, dtype, device or layout, or caches not of a code
    dtype."""
    if k_scale is None and v_scale is None:
        return None
    if k_scale is None or v_scale is None:
        raise ValueError("k_scale and v_scale go together: pass both (quantized cache) or neither")
    code_format = KV_CODE_FORMATS.get(k_cache.dtype)
    if code_format is None or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"a quantized cache holds one of {tuple(KV_CODE_FORMATS)} codes, got "
            f"{k_cache.dtype} and {v_cache.dtype}"
        )
    if not key.is_floating_point() or value.dtype != key.dtype or key.dtype in KV_CODE_FORMATS:
        raise ValueError(f"key/value must be fp32/fp16/bf16 alike, got {key.dtype}, {value.dtype}")
    shape = tuple(k_cache.shape[:3])
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if tuple(t.shape) != shape or t.dtype != torch.float32:
            raise ValueError(
                f"{name} must be fp32 {shape} (one scale per slot and KV head), got "
                f"{t.dtype} {tuple(t.shape)}"
            )
        if t.device != key.device or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous on {key.device}, got {t.device}")
    return code_format


def write_latent(
    latent: torch.Tensor,
    latent_cache: torch.Tensor,
    *,
    slot_mapping: torch.Tensor,
    latent_scale: torch.Tensor | None = None,
) -> None:
    """Write ``latent [T, C]`` (a latent cache's entries) into ``latent_cache [num_blocks,
    block_size, C]`` at ``slot_mapping [T]`` (int64, ``-1``: skip); the same kernel as
    :func:`write_kv`, one "head" and no value side. In place; bit-exact. With ``latent_scale``
    (``[num_blocks, block_size]`` fp32, contiguous) the cache holds int8 / float8_e4m3fn /
    float8_e5m2 codes and each entry is quantized as one head (``quantize_kv_ref``): one scale
    per token."""
    if latent.dim() != 2 or latent_cache.dim() != 3:
        raise ValueError(
            f"latent must be [T, C] and latent_cache [num_blocks, block_size, C], got "
            f"{tuple(latent.shape)} and {tuple(latent_cache.shape)}"
        )
    num_tokens, width = latent.shape
    code_format = _check_latent_scale(latent, latent_cache, latent_scale)
    if latent_cache.shape[2] != width or (
        code_format is None and latent_cache.dtype != latent.dtype
    ):
        raise ValueError(
            f"latent_cache entries {latent_cache.shape[2]} {latent_cache.dtype} do not match "
            f"latent {width} {latent.dtype}"
        )
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"slot_mapping must be int64 [{num_tokens}], got {slot_mapping.dtype} "
            f"{tuple(slot_mapping.shape)}"
        )
    for name, t in (("latent_cache", latent_cache), ("slot_mapping", slot_mapping)):
        if t.device != latent.device:
            raise ValueError(f"{name} is on {t.device}, latent is on {latent.device}")
    check_device(latent.device)
    if not latent_cache.is_contiguous() or latent.stride(-1) != 1:
        raise ValueError("latent_cache must be contiguous, latent's last dim too")
    if not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be contiguous")
    if num_tokens == 0:
        return
    quant = {}
    if code_format is not None:
        quant = dict(
            QUANT=True,
            QMAX=code_format.qmax,
            INT_CODES=code_format.is_int,
            MANTISSA=code_format.mantissa_bits,
            MIN_EXP=code_format.min_exponent,
        )
    _write_kv_kernel[(num_tokens, 1)](
        latent,
        latent,
        latent_cache,
        latent_cache,
        slot_mapping,
        1,
        latent.stride(0),
        0,
        latent.stride(0),
        0,
        latent_cache.stride(1),
        0,
        latent_cache if latent_scale is None else latent_scale,  # unused without QUANT
        latent_cache,  # no value side
        0 if latent_scale is None else latent_scale.stride(1),
        HEAD_DIM=width,
        BLOCK_H=1,
        BLOCK_D=triton.next_power_of_2(width),
        WRITE_VALUE=False,
        **quant,
    )


def _check_latent_scale(
    latent: torch.Tensor, latent_cache: torch.Tensor, latent_scale: torch.Tensor | None
) -> KvCodeFormat | None:
    """The code format of a quantized latent write (None: ``latent_scale`` not given);
    ValueError for a cache not of a code dtype, a latent not of a float dtype, or a scale
    tensor that is not contiguous fp32 ``[num_blocks, block_size]`` on the latent's device."""
    if latent_scale is None:
        return None
    code_format = KV_CODE_FORMATS.get(latent_cache.dtype)
    if code_format is None:
        raise ValueError(
            f"a quantized latent cache holds one of {tuple(KV_CODE_FORMATS)} codes, got "
            f"{latent_cache.dtype}"
        )
    if not latent.is_floating_point() or latent.dtype in KV_CODE_FORMATS:
        raise ValueError(f"latent must be fp32/fp16/bf16, got {latent.dtype}")
    shape = tuple(latent_cache.shape[:2])
    if tuple(latent_scale.shape) != shape or latent_scale.dtype != torch.float32:
        raise ValueError(
            f"latent_scale must be fp32 {shape} (one scale per slot), got "
            f"{latent_scale.dtype} {tuple(latent_scale.shape)}"
        )
    if latent_scale.device != latent.device or not latent_scale.is_contiguous():
        raise ValueError(
            f"latent_scale must be contiguous on {latent.device}, got {latent_scale.device}"
        )
    return code_format
