"""KV block copy: copy whole cache blocks (copy-on-write) for every layer and side in one launch.

Semantics are exactly those of :func:`paged_serve.kernels.reference.copy_blocks_ref`: for each row
``(src, dst)`` of ``block_mapping``, ``kv_caches[:, :, dst] = kv_caches[:, :, src]`` where
``kv_caches`` is the engine's single ``[num_layers, sides, num_blocks, block_size, Hkv, D]``
allocation (2 sides, K and V; 1 for a latent cache, ``kernels/triton/mla_attention.py``).
Pure data movement, bit-exact. Destinations must be distinct and never a source in the same
call (the engine's copy-on-write guarantees it), so the programs never race.

Grid: ``(N, num_layers * sides, cdiv(block_numel, CHUNK))``. A block is ``block_numel =
block_size * Hkv * D`` contiguous elements; each program copies one ``CHUNK``-element slice
(``CHUNK`` = block_numel rounded up to a power of two, capped at 4096) of one block of one
(layer, side). All offsets are int64.

A quantized cache (``kernels/interface.py``'s ``WriteKv``) is copied by two calls: its int8 /
fp8 codes ``[L, 2, num_blocks, block_size, Hkv, D]``, then its fp32 scales ``[L, 2, num_blocks,
block_size, Hkv]`` viewed as ``[..., Hkv, 1]``. fp8 codes are copied as their bytes (a uint8
view): the copy stays exact and needs no fp8 load, which GPUs before sm_89 lack.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl
from paged_serve.kernels.triton.runtime import check_device

_MAX_CHUNK = 4096


@triton.jit
def _copy_blocks_kernel(
    cache_ptr,
    block_mapping_ptr,
    num_blocks,
    block_numel,
    CHUNK: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)
    layer_side = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(2).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_numel
    src = tl.load(block_mapping_ptr + 2 * pair)
    dst = tl.load(block_mapping_ptr + 2 * pair + 1)
    side_base = layer_side * num_blocks
    x = tl.load(cache_ptr + (side_base + src) * block_numel + offs, mask=mask)
    tl.store(cache_ptr + (side_base + dst) * block_numel + offs, x, mask=mask)


def copy_blocks(kv_caches: torch.Tensor, *, block_mapping: torch.Tensor) -> None:
    """Copy blocks ``block_mapping [N, 2]`` (int64 ``(src, dst)`` rows) in every layer and side.

    kv_caches: ``[num_layers, sides, num_blocks, block_size, Hkv, D]`` (sides 2, or 1 for a
    latent cache), contiguous, of any dtype (int8 and fp8 codes, or a quantized cache's scales
    viewed ``[..., Hkv, 1]``, too). Block ids are not range-checked (that would need a device
    sync). In place; bit-exact.
    """
    # kv_caches: [L, sides, num_blocks, block_size, Hkv, D]; block_mapping: [N, 2]
    if kv_caches.dim() != 6 or kv_caches.shape[1] not in (1, 2):
        raise ValueError(
            "kv_caches must be [num_layers, 1 or 2, num_blocks, block_size, Hkv, D], got "
            f"{tuple(kv_caches.shape)}"
        )
    if block_mapping.dtype != torch.int64:
        raise ValueError(f"block_mapping must be int64, got {block_mapping.dtype}")
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must be [N, 2], got {tuple(block_mapping.shape)}")
    if block_mapping.device != kv_caches.device:
        raise ValueError(
            f"block_mapping is on {block_mapping.device}, kv_caches on {kv_caches.device}"
        )
    check_device(kv_caches.device)
    if not kv_caches.is_contiguous():
        raise ValueError("kv_caches must be contiguous (one allocation for all layers)")
    if not block_mapping.is_contiguous():
        raise ValueError("block_mapping must be contiguous")
    num_pairs = block_mapping.shape[0]
    num_layers, sides, num_blocks = kv_caches.shape[:3]
    block_numel = kv_caches[0, 0, 0].numel()
    if num_pairs == 0 or num_layers == 0 or block_numel == 0:
        return

    if kv_caches.is_floating_point() and kv_caches.element_size() == 1:  # fp8: copy the bytes
        kv_caches = kv_caches.view(torch.uint8)
    chunk = min(triton.next_power_of_2(block_numel), _MAX_CHUNK)
    grid = (num_pairs, num_layers * sides, triton.cdiv(block_numel, chunk))
    _copy_blocks_kernel[grid](kv_caches, block_mapping, num_blocks, block_numel, CHUNK=chunk)
