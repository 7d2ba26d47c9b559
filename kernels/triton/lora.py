"""Batched multi-LoRA: every token of a step through its own adapter (Punica's BGMV).

A LoRA adapter adds ``(x @ A^T) @ B`` (its scaling folded into B) to a base projection's output.
A step mixes requests of different adapters, so the adapters' matrices are stacked by *slot*
and each token names its slot; semantics are those of
:func:`paged_serve.kernels.reference.lora_shrink_ref` and ``lora_expand_ref``::

    x            [T, K]     the projection's input, fp32/bf16/fp16, rows contiguous
    a            [S, R, K]  A of the adapter in each slot, x's dtype, contiguous
    token_slots  [T] int32  each token's slot; -1: the token has no adapter
    s            [T, R]     fp32: s[t] = a[slot_t] @ x[t]          (shrink; 0 where slot_t = -1)
    b            [S, R, N]  B of the adapter in each slot, y's dtype, contiguous
    y            [T, N]     the base output, updated in place: y[t] += s[t] @ b[slot_t]
                                                                   (expand; untouched if -1)

R is the adapter's rank (a slot holds the largest rank served, smaller adapters padded with
zero rows; several projections fused in one call stack their ranks, e.g. 3 * 16 for q, k, v).

Algorithm and grid
------------------
BGMV, batched gather matrix-vector: no grouping of tokens by adapter, no sort and no host
sync. Each program owns one token and reads its adapter's matrices itself:

* shrink, grid ``(T, ceil(R / BLOCK_R))``: program ``(t, j)`` walks K in ``BLOCK_K`` steps,
  multiplying the tile ``a[slot_t, rows of tile j, k-step] [BLOCK_R, BLOCK_K]`` by ``x[t,
  k-step]`` and summing along K into ``BLOCK_R`` fp32 accumulators.
* expand, grid ``(T, ceil(N / BLOCK_N))``: program ``(t, j)`` walks R in ``BLOCK_R`` steps,
  summing ``s[t, r-step, None] * b[slot_t, r-step, columns of tile j]`` along R into
  ``BLOCK_N`` fp32 accumulators, then adds them to y's tile in fp32 and stores y's dtype.

A matrix-vector product per token does no better with ``tl.dot`` (M = 1), and the adapters'
matrices are small (R x K) and shared by the tokens of a request, so they are read from L2
after the first token. A token with slot -1 exits at once: shrink writes its zero row, expand
writes nothing, and neither reads a or b.

The slots have a fixed size and the launch depends only on the shapes (``launch_settings``),
never on which slots the tokens use, so a CUDA graph captured with a static ``token_slots``
buffer replays correctly whatever the buffer holds (shrink's output comes from the caller as
``out`` there). Slot numbers are not checked against S: that would need a host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import triton
import triton.language as tl
from paged_serve.kernels.triton.runtime import check_device

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MIN_BLOCK_R = 16  # no power-of-two tile narrower than this: ranks of 1 and 8 share it
MAX_BLOCK_R = 64  # wider ranks (fused projections: 3 * 64) take several tiles
BLOCK_K = 128  # shrink's K step: a [BLOCK_R, 128] tile of A per step
BLOCK_N = 64  # expand's output tile: decode's few tokens still make T * N / 64 programs


@dataclass(frozen=True, slots=True)
class LoraLaunch:
    """Tiles of both kernels: ranks per tile, K per shrink step, outputs per expand tile."""

    block_r: int
    block_k: int
    block_n: int
    num_warps: int


def launch_settings(rank: int) -> LoraLaunch:
    """The tiles for rank ``rank``: the rank rounded up to a power of two within
    [``MIN_BLOCK_R``, ``MAX_BLOCK_R``]; fixed K and N tiles (no dependence on T or the slots,
    so a captured graph replays any step of the same shapes)."""
    block_r = min(MAX_BLOCK_R, max(MIN_BLOCK_R, triton.next_power_of_2(rank)))
    return LoraLaunch(block_r=block_r, block_k=BLOCK_K, block_n=BLOCK_N, num_warps=4)


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    slots_ptr,
    s_ptr,
    R,
    K,
    stride_xt,
    stride_as,
    stride_ar,
    stride_st,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs_r = tl.program_id(1).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot < 0:  # no adapter: a zero row, and a is never read
        tl.store(s_ptr + token * stride_st + offs_r, tl.zeros([BLOCK_R], tl.float32), r_mask)
        return
    a_rows = a_ptr + slot * stride_as + offs_r[:, None] * stride_ar
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + token * stride_xt + offs_k, mask=k_mask, other=0.0)
        a = tl.load(a_rows + offs_k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(s_ptr + token * stride_st + offs_r, acc, mask=r_mask)


@triton.jit
def _lora_expand_kernel(
    s_ptr,
    b_ptr,
    slots_ptr,
    y_ptr,
    R,
    N,
    stride_st,
    stride_bs,
    stride_br,
    stride_yt,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot < 0:  # no adapter: y's row stays the base output, bit for bit
        return
    offs_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    b_slot = b_ptr + slot * stride_bs
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < R
        s = tl.load(s_ptr + token * stride_st + offs_r, mask=r_mask, other=0.0)
        b = tl.load(
            b_slot + offs_r[:, None] * stride_br + offs_n[None, :],
            mask=r_mask[:, None] & n_mask[None, :],
            other=0.0,
        )
        acc += tl.sum(s.to(tl.float32)[:, None] * b.to(tl.float32), axis=0)
    y_row = y_ptr + token * stride_yt + offs_n
    y = tl.load(y_row, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_row, (y + acc).to(y_ptr.dtype.element_ty), mask=n_mask)


def _check_slots(token_slots: torch.Tensor, tokens: int, device: torch.device) -> None:
    if (
        token_slots.shape != (tokens,)
        or token_slots.dtype != torch.int32
        or not token_slots.is_contiguous()
    ):
        raise ValueError(
            f"token_slots must be a contiguous [{tokens}] int32, "
            f"got {tuple(token_slots.shape)} {token_slots.dtype}"
        )
    if token_slots.device != device:
        raise ValueError(f"token_slots is on {token_slots.device}, the activations on {device}")


def _check_rows(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    """``t`` is 2-D in one of ``dtypes`` with contiguous rows (any row stride)."""
    if t.dim() != 2 or t.dtype not in dtypes or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(
            f"{name} must be 2-D {dtypes} with contiguous rows, "
            f"got {tuple(t.shape)} {t.dtype} strides {t.stride()}"
        )


def _check_weights(name: str, w: torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
    if w.dim() != 3 or w.dtype != dtype or not w.is_contiguous() or w.device != device:
        raise ValueError(
            f"{name} must be a contiguous [S, R, *] {dtype} on {device}, "
            f"got {tuple(w.shape)} {w.dtype} on {w.device} (contiguous: {w.is_contiguous()})"
        )


def lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    token_slots: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each token's input through its adapter's A: ``s [T, R]`` fp32, ``s[t] = a[slot_t] @
    x[t]`` summed in fp32; rows of slot -1 are zeros.

    x: ``[T, K]`` fp32/bf16/fp16, rows contiguous (any row stride); a: ``[S, R, K]`` contiguous
    in x's dtype; token_slots: ``[T]`` int32 in ``[-1, S)``; out: ``[T, R]`` fp32 with
    contiguous rows to write into (a CUDA graph's static buffer), else allocated.
    """
    check_device(x.device)
    _check_rows("x", x, DTYPES)
    tokens, k = x.shape
    _check_weights("a", a, x.dtype, x.device)
    if a.shape[2] != k:
        raise ValueError(f"a's inputs {a.shape[2]} differ from x's K={k}")
    _check_slots(token_slots, tokens, x.device)
    rank = a.shape[1]
    if out is None:
        out = torch.empty(tokens, rank, dtype=torch.float32, device=x.device)
    _check_rows("out", out, (torch.float32,))
    if out.shape != (tokens, rank) or out.device != x.device:
        raise ValueError(f"out must be [{tokens}, {rank}] on {x.device}, got {tuple(out.shape)}")
    if tokens == 0 or rank == 0:
        return out
    launch = launch_settings(rank)
    _lora_shrink_kernel[(tokens, triton.cdiv(rank, launch.block_r))](
        x,
        a,
        token_slots,
        out,
        rank,
        k,
        x.stride(0),
        a.stride(0),
        a.stride(1),
        out.stride(0),
        BLOCK_R=launch.block_r,
        BLOCK_K=launch.block_k,
        num_warps=launch.num_warps,
    )
    return out


def lora_expand(
    s: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, y: torch.Tensor
) -> None:
    """Each token's shrunk row through its adapter's B, added to y in place: ``y[t] += s[t] @
    b[slot_t]`` summed in fp32, added to y in fp32, stored in y's dtype; rows of slot -1 are
    left untouched.

    s: ``[T, R]`` fp32, rows contiguous; b: ``[S, R, N]`` contiguous in y's dtype; token_slots:
    ``[T]`` int32 in ``[-1, S)``; y: ``[T, N]`` fp32/bf16/fp16, rows contiguous (any row
    stride: a column slice of a fused projection's output).
    """
    check_device(y.device)
    _check_rows("y", y, DTYPES)
    tokens, n = y.shape
    _check_rows("s", s, (torch.float32,))
    _check_weights("b", b, y.dtype, y.device)
    rank = b.shape[1]
    if s.shape != (tokens, rank) or s.device != y.device:
        raise ValueError(
            f"s must be [{tokens}, {rank}] (y's tokens, b's rank) on {y.device}, "
            f"got {tuple(s.shape)} on {s.device}"
        )
    if b.shape[2] != n:
        raise ValueError(f"b's outputs {b.shape[2]} differ from y's N={n}")
    _check_slots(token_slots, tokens, y.device)
    if tokens == 0 or n == 0 or rank == 0:
        return
    launch = launch_settings(rank)
    _lora_expand_kernel[(tokens, triton.cdiv(n, launch.block_n))](
        s,
        b,
        token_slots,
        y,
        rank,
        n,
        s.stride(0),
        b.stride(0),
        b.stride(1),
        y.stride(0),
        BLOCK_R=launch.block_r,
        BLOCK_N=launch.block_n,
        num_warps=launch.num_warps,
    )
