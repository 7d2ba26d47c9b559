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
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl
from paged_serve.kernels.triton.runtime import check_device

_MAX_TILE = 4096


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
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WRITE_VALUE: tl.constexpr = True,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < num_kv_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
    cache_off = slot * stride_cache_slot + offs_h[:, None] * stride_cache_head + offs_d[None, :]

    k = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask)
    tl.store(k_cache_ptr + cache_off, k, mask=mask)
    if WRITE_VALUE:
        v = tl.load(
            value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask
        )
        tl.store(v_cache_ptr + cache_off, v, mask=mask)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into the caches at ``slot_mapping [T]`` (int64).

    k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, contiguous, same dtype as key/value.
    Slots must be ``-1`` or ``< num_blocks * block_size`` (not checked: that would need a sync).
    In place; bit-exact.
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
    if len({key.dtype, value.dtype, k_cache.dtype, v_cache.dtype}) != 1:
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
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
    )


def write_latent(
    latent: torch.Tensor, latent_cache: torch.Tensor, *, slot_mapping: torch.Tensor
) -> None:
    """Write ``latent [T, C]`` (a latent cache's entries) into ``latent_cache [num_blocks,
    block_size, C]`` at ``slot_mapping [T]`` (int64, ``-1``: skip); the same kernel as
    :func:`write_kv`, one "head" and no value side. In place; bit-exact."""
    if latent.dim() != 2 or latent_cache.dim() != 3:
        raise ValueError(
            f"latent must be [T, C] and latent_cache [num_blocks, block_size, C], got "
            f"{tuple(latent.shape)} and {tuple(latent_cache.shape)}"
        )
    num_tokens, width = latent.shape
    if latent_cache.shape[2] != width or latent_cache.dtype != latent.dtype:
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
        HEAD_DIM=width,
        BLOCK_H=1,
        BLOCK_D=triton.next_power_of_2(width),
        WRITE_VALUE=False,
    )
