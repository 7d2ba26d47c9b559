"""Input checks of ``paged_serve.kernels.triton.paged_attention.paged_attention``, and the sizes
they establish.

Shapes, dtypes, devices, contiguity, GQA divisibility and the scalar arguments: each failure
raises ``ValueError`` naming the offending values. Nothing here reads a device tensor's
contents (that would be a host sync), so block ids, sequence lengths and ``max_seqlen_*`` are
trusted to agree with the tensors. ``check_attention_inputs`` returns the sizes it read as an
``AttentionShapes`` record, from which the launcher derives its launch settings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from paged_serve.kernels.triton.runtime import check_device, zeroed_tickets

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# A quantized cache's codes (kernels/interface.py's WriteKv), beside fp32 per-slot scales.
KV_CODE_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
MAX_HEAD_DIM = 256
MAX_GROUP = 128


@dataclass(frozen=True, slots=True)
class AttentionShapes:
    """The sizes of one call: ``q [T, Hq, D]``, caches ``[num_blocks, block_size, Hkv, D]``,
    ``S`` sequences."""

    num_tokens: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_seqs: int

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.num_q_heads // self.num_kv_heads


def check_attention_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    max_seqlen_q: int,
    max_seqlen_k: int,
    sliding_window: int | None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> AttentionShapes:
    """Check everything but ``out``, ``workspace`` and ``num_kv_splits``; return the sizes.
    ``k_scale``, ``v_scale``: a quantized cache's scales (both or neither)."""
    # q: [T, Hq, D]; caches: [num_blocks, block_size, Hkv, D]
    quantized = check_kv_scales(k_scale, v_scale, k_cache, q.device)
    _check_q_and_caches(q, k_cache, v_cache, quantized=quantized)
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"cache head_dim {cache_head_dim} != q head_dim {head_dim}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {num_kv_heads}"
        )
    group = num_q_heads // num_kv_heads
    if group > MAX_GROUP:
        raise ValueError(f"GQA group {group} exceeds {MAX_GROUP}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")

    num_seqs = check_step_metadata(block_tables, seq_lens, cu_seqlens_q, q.device)
    check_step_bounds(
        block_tables, block_size, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, scale=scale
    )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    return AttentionShapes(num_tokens, num_q_heads, num_kv_heads, head_dim, block_size, num_seqs)


def check_step_bounds(
    block_tables: torch.Tensor,
    block_size: int,
    *,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
) -> None:
    """The step's host-side maxima fit its block tables, and the softmax scale is finite."""
    if max_seqlen_q < 0 or max_seqlen_k < 0:
        raise ValueError(f"max_seqlen_q {max_seqlen_q} / max_seqlen_k {max_seqlen_k} < 0")
    if max_seqlen_k > block_tables.shape[1] * block_size:
        raise ValueError(
            f"max_seqlen_k {max_seqlen_k} exceeds block_tables capacity "
            f"{block_tables.shape[1]} blocks x {block_size}"
        )
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")


def check_out(out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """``out`` if it is a valid ``[T, Hq, D]`` output in q's dtype (row strides free), else a
    new one when ``out`` is None."""
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(
            f"out must be {tuple(q.shape)} {q.dtype} on {q.device}, got "
            f"{tuple(out.shape)} {out.dtype} on {out.device}"
        )
    if out.stride(-1) != 1:
        raise ValueError(f"out's last dim must be contiguous, got strides {out.stride()}")
    return out


def check_sinks(
    sinks: torch.Tensor | None, shapes: AttentionShapes, device: torch.device
) -> torch.Tensor | None:
    """``sinks`` as contiguous fp32 ``[Hq]`` (a small copy when it is in another dtype, as a
    model's bf16 parameter is), or None; ValueError for another shape or device."""
    if sinks is None:
        return None
    if sinks.shape != (shapes.num_q_heads,) or sinks.device != device:
        raise ValueError(
            f"sinks must be [{shapes.num_q_heads}] (one per query head) on {device}, got "
            f"{tuple(sinks.shape)} on {sinks.device}"
        )
    if not sinks.is_floating_point():
        raise ValueError(f"sinks must be a float tensor, got {sinks.dtype}")
    return sinks.detach().to(torch.float32).contiguous()


def check_workspace(
    workspace: torch.Tensor | None, *, numel: int, device: torch.device
) -> torch.Tensor:
    """``workspace`` if it is contiguous fp32 on ``device`` with >= ``numel`` elements, else a
    new one of exactly ``numel`` when ``workspace`` is None."""
    if workspace is None:
        return torch.empty(numel, dtype=torch.float32, device=device)
    if (
        workspace.dtype != torch.float32
        or workspace.device != device
        or not workspace.is_contiguous()
        or workspace.numel() < numel
    ):
        raise ValueError(
            f"workspace must be contiguous fp32 on {device} with >= {numel} elements, got "
            f"{workspace.dtype} on {workspace.device} with {workspace.numel()}"
        )
    return workspace


def check_tickets(
    tickets: torch.Tensor | None, *, count: int, device: torch.device
) -> torch.Tensor:
    """A fused split-KV merge's counters: ``tickets`` if it is contiguous int32 on ``device``
    with >= ``count`` elements (the caller keeps them zero between launches, as the kernels
    leave them), else, when None, ``count`` counters of the device's pool."""
    if tickets is None:
        return zeroed_tickets(device, count)
    if (
        tickets.dtype != torch.int32
        or tickets.device != device
        or not tickets.is_contiguous()
        or tickets.numel() < count
    ):
        raise ValueError(
            f"tickets must be contiguous int32 on {device} with >= {count} elements, got "
            f"{tickets.dtype} on {tickets.device} with {tickets.numel()}"
        )
    return tickets


def check_kv_scales(
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    k_cache: torch.Tensor,
    device: torch.device,
) -> bool:
    """Whether the cache is quantized: both scales given, each contiguous fp32 ``[num_blocks,
    block_size, Hkv]`` on ``device``; False with neither, ValueError otherwise."""
    if k_scale is None and v_scale is None:
        return False
    if k_scale is None or v_scale is None:
        raise ValueError("k_scale and v_scale go together: pass both (quantized cache) or neither")
    shape = tuple(k_cache.shape[:3])
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if tuple(t.shape) != shape or t.dtype != torch.float32:
            raise ValueError(
                f"{name} must be fp32 {shape} (one scale per slot and KV head), got "
                f"{t.dtype} {tuple(t.shape)}"
            )
        if t.device != device or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous on {device}, got {t.device}")
    return True


def _check_q_and_caches(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, quantized: bool
) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, Hkv, D], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q dtype must be one of {SUPPORTED_DTYPES}, got {q.dtype}")
    if quantized:
        if k_cache.dtype not in KV_CODE_DTYPES or v_cache.dtype != k_cache.dtype:
            raise ValueError(
                f"a quantized cache (k_scale, v_scale given) holds one of {KV_CODE_DTYPES} "
                f"codes, got {k_cache.dtype} and {v_cache.dtype}"
            )
    elif k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(
            f"cache dtypes ({k_cache.dtype}, {v_cache.dtype}) must equal q dtype {q.dtype}"
        )
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q is on {q.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    check_device(q.device)
    if q.stride(-1) != 1:
        raise ValueError(f"q's last dim must be contiguous, got strides {q.stride()}")


def check_step_metadata(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    device: torch.device,
) -> int:
    """Check the step metadata; returns the number of sequences ``S``."""
    # block_tables: [S, max_blocks]; seq_lens: [S]; cu_seqlens_q: [S + 1]; all int32
    _check_int_tensor("block_tables", block_tables, 2, device)
    _check_int_tensor("seq_lens", seq_lens, 1, device)
    _check_int_tensor("cu_seqlens_q", cu_seqlens_q, 1, device)
    num_seqs = seq_lens.shape[0]
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {num_seqs} seqs")
    if cu_seqlens_q.shape[0] != num_seqs + 1:
        raise ValueError(f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries, need {num_seqs + 1}")
    return num_seqs


def _check_int_tensor(name: str, t: torch.Tensor, ndim: int, device: torch.device) -> None:
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, q is on {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
