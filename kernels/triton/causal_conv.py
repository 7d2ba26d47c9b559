"""Depthwise causal convolution of ragged sequences over per-sequence windows (gated DeltaNet).

Semantics are exactly those of :func:`paged_serve.kernels.reference.causal_conv1d_ref`: each
sequence's rows of ``x [T, C]`` continue from its window ``conv_state[slot] [K - 1, C]`` (zeros
where ``has_state`` is 0), ``out[t, c] = silu(bias[c] + sum_j weight[c, j] * ext[t + j, c])``, and
the window becomes the last ``K - 1`` rows of ``ext`` = window then rows. Prefill chunks and decode
rows (one row each) take the same kernel.

Grid: ``(S, cdiv(C, BLOCK_C))``. A program walks its sequence in ``BLOCK_T``-row tiles; tap
``j`` of row ``t`` reads input row ``t - (K - 1) + j``, from ``x`` when that is inside the
sequence and from the old window otherwise, so tiles need no carried registers. The new window
is gathered the same way after the last tile and stored after a barrier, since it may overwrite
rows of the old window that other lanes of the program still read. Channels are the contiguous
dim of ``x``, ``out`` and the window, so every load is coalesced. Math in fp32.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl
from paged_serve.kernels.triton.runtime import check_device

_BLOCK_T = 16
_BLOCK_C = 128


@triton.jit
def _causal_conv_kernel(
    x_ptr,
    weight_ptr,
    bias_ptr,
    state_ptr,
    out_ptr,
    cu_seqlens_ptr,
    state_slots_ptr,
    has_state_ptr,
    channels,
    stride_xt,
    stride_ot,
    stride_slot,
    stride_row,
    WIDTH: tl.constexpr,
    WINDOW_P2: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    seq = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = offs_c < channels
    start = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    length = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64) - start
    slot = tl.load(state_slots_ptr + seq).to(tl.int64)
    # Window rows a tap may read (-avail <= src < 0): none for a fresh sequence.
    avail = tl.where(tl.load(has_state_ptr + seq) != 0, WIDTH - 1, 0)
    window = state_ptr + slot * stride_slot
    bias = tl.zeros([BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_c, mask=c_mask, other=0.0).to(tl.float32)

    for t0 in range(0, length, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        t_mask = offs_t < length
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32) + bias[None, :]
        for j in tl.static_range(WIDTH):
            src = offs_t - (WIDTH - 1) + j  # input row, < 0: row WIDTH - 1 + src of the window
            in_x = (t_mask & (src >= 0))[:, None] & c_mask[None, :]
            in_w = (t_mask & (src < 0) & (src >= -avail))[:, None] & c_mask[None, :]
            xv = tl.load(
                x_ptr + (start + src)[:, None] * stride_xt + offs_c[None, :], mask=in_x, other=0.0
            )
            wv = tl.load(
                window + (WIDTH - 1 + src)[:, None] * stride_row + offs_c[None, :],
                mask=in_w,
                other=0.0,
            )
            tap = tl.load(weight_ptr + offs_c * WIDTH + j, mask=c_mask, other=0.0)
            acc += (xv.to(tl.float32) + wv.to(tl.float32)) * tap.to(tl.float32)[None, :]
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(
            out_ptr + (start + offs_t)[:, None] * stride_ot + offs_c[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=t_mask[:, None] & c_mask[None, :],
        )

    # The new window: rows length .. length + K - 2 of ext = (old window, x).
    rows = tl.arange(0, WINDOW_P2)
    r_mask = rows < WIDTH - 1
    src = length - (WIDTH - 1) + rows
    in_x = (r_mask & (src >= 0))[:, None] & c_mask[None, :]
    in_w = (r_mask & (src < 0) & (src >= -avail))[:, None] & c_mask[None, :]
    xv = tl.load(x_ptr + (start + src)[:, None] * stride_xt + offs_c[None, :], mask=in_x, other=0.0)
    wv = tl.load(
        window + (WIDTH - 1 + src)[:, None] * stride_row + offs_c[None, :], mask=in_w, other=0.0
    )
    new = xv.to(state_ptr.dtype.element_ty) + wv.to(state_ptr.dtype.element_ty)
    tl.debug_barrier()
    tl.store(
        window + rows[:, None] * stride_row + offs_c[None, :],
        new,
        mask=r_mask[:, None] & c_mask[None, :],
    )


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    state_slots: torch.Tensor,
    has_state: torch.Tensor,
    silu: bool = True,
) -> torch.Tensor:
    """``out [T, C]`` (x's dtype) of the depthwise causal convolution of ``x [T, C]`` (channels
    contiguous) with ``weight [C, K]``, ``bias [C]`` or None, continuing each sequence's window
    ``conv_state [num_slots, K - 1, C]`` (contiguous; updated in place). ``cu_seqlens [S + 1]``,
    ``state_slots [S]`` int32, ``has_state [S]`` (0: a fresh sequence)."""
    if x.dim() != 2 or weight.dim() != 2 or conv_state.dim() != 3:
        raise ValueError(
            f"x must be [T, C], weight [C, K], conv_state [slots, K - 1, C]; got "
            f"{tuple(x.shape)}, {tuple(weight.shape)}, {tuple(conv_state.shape)}"
        )
    channels, width = weight.shape
    if x.shape[1] != channels or tuple(conv_state.shape[1:]) != (width - 1, channels):
        raise ValueError(
            f"x {tuple(x.shape)} and conv_state {tuple(conv_state.shape)} do not match "
            f"weight [C, K] = {(channels, width)}"
        )
    if width < 2:
        raise ValueError(f"a causal convolution window needs K >= 2, got {width}")
    if bias is not None and bias.shape != (channels,):
        raise ValueError(f"bias must be [{channels}], got {tuple(bias.shape)}")
    num_seqs = state_slots.shape[0]
    if cu_seqlens.shape != (num_seqs + 1,) or has_state.shape != (num_seqs,):
        raise ValueError(
            f"cu_seqlens [S + 1], state_slots [S], has_state [S]: got {tuple(cu_seqlens.shape)}, "
            f"{tuple(state_slots.shape)}, {tuple(has_state.shape)}"
        )
    for name, t in (("weight", weight), ("conv_state", conv_state), ("cu_seqlens", cu_seqlens)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x is on {x.device}")
    check_device(x.device)
    if x.stride(1) != 1 or not conv_state.is_contiguous() or not weight.is_contiguous():
        raise ValueError("x's channels, conv_state and weight must be contiguous")
    out = torch.empty_like(x)
    if num_seqs == 0:
        return out
    _causal_conv_kernel[(num_seqs, triton.cdiv(channels, _BLOCK_C))](
        x,
        weight,
        bias if bias is not None else weight,
        conv_state,
        out,
        cu_seqlens,
        state_slots,
        has_state,
        channels,
        x.stride(0),
        out.stride(0),
        conv_state.stride(0),
        conv_state.stride(1),
        **conv_constants(width, has_bias=bias is not None, silu=silu),
    )
    return out


def conv_constants(width: int, *, has_bias: bool, silu: bool) -> dict[str, int | bool]:
    """The compile-time arguments of a launch (ci/aot_compile.py builds the same)."""
    return dict(
        WIDTH=width,
        WINDOW_P2=triton.next_power_of_2(width - 1),
        HAS_BIAS=has_bias,
        SILU=silu,
        BLOCK_T=_BLOCK_T,
        BLOCK_C=_BLOCK_C,
    )
