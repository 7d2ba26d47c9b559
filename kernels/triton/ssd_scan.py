"""Mamba-2's selective state-space scan over ragged sequences and per-sequence state slots.

Semantics are exactly those of :func:`paged_serve.kernels.reference.ssd_scan_ref`: per head
``h``, with ``S [P, N]`` starting from ``state[slot]`` (zeros where ``has_state`` is 0), each
token does ``S = exp(dt A) S + dt x B^T`` and emits ``y = S C + D x``; head ``h`` reads the B, C
of group ``h // (H // G)``, and the final ``S`` goes back to the slot.

Two kernels, one grid ``(S, H, cdiv(P, BLOCK_P))``; each program keeps its ``[BLOCK_P, N]``
slice of ``S`` in registers (fp32) for its whole sequence (a row ``p`` of ``S`` only ever meets
row ``p`` of x, so the P lanes split freely; the N lanes do not, ``C B^T`` sums over them):

* **recurrent** (decode steps): the definition, one token at a time.
* **chunked** (any step with a prefill chunk; its decode rows too), the state-space dual form:
  ``BLOCK_T`` tokens at a time. Write ``a_t = dt_t A`` (the log decay of token t, <= 0) and
  ``c_t = a_0 + ... + a_t`` its running sum inside the chunk. Unrolling the recurrence from the
  state ``S0`` the chunk starts with, token t's state is

      S_t = exp(c_t) S0 + sum_{s <= t} exp(c_t - c_s) dt_s x_s B_s^T

  so its output splits in two matrix products over the chunk:

      y_t = exp(c_t) (S0 C_t)                                   (what the carried state says)
          + sum_{s <= t} (C_t . B_s) exp(c_t - c_s) dt_s x_s     (the chunk's own tokens)

  the second a causal ``[BLOCK_T, BLOCK_T]`` mixing matrix ``M = (C B^T) * exp(c_t - c_s) *
  dt_s`` (zero above the diagonal) times x. The state the next chunk starts with is the same
  unrolling at the chunk's last token, ``S = exp(c_last) S0 + (x * w)^T B`` with ``w_s =
  exp(c_last - c_s) dt_s``. All of it is dots of ``BLOCK_T``-token tiles; only ``S`` is carried
  from chunk to chunk. Rows past the sequence's end load as zeros (x, B, C and dt, so ``a =
  0``): they add nothing to ``S`` and their outputs are not stored.

Each program holds its state slice transposed, ``S^T [N, BLOCK_P]``, and loads B transposed,
so every dot takes its tiles as they are: ``C B^T``, ``C S^T`` and ``B^T (x * w)`` need no
register transposes. Tiles (ci/aot_compile.py builds them for sm_90 at Mamba-2's P = 64, N =
128): the recurrent kernel ``BLOCK_P = 16`` lanes over 4 warps; the chunked one ``BLOCK_T = 32``
tokens by ``BLOCK_P = 16`` lanes (32 where N <= 64) over 8 warps, the largest without spills.

Math in fp32: exponents are differences of running sums, all <= 0, so nothing overflows. The
chunked kernel's dots run on TF32 tensor cores; as for the delta rule, fp32 inputs on a GPU
take the recurrent kernel instead (``uses_chunked_kernel``). The choice is made on the host from
``max_seqlen_q`` alone: a launch reads no device value back, so a decode step is CUDA-graph safe.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl
from paged_serve.kernels.triton.runtime import check_device

_BLOCK_P = 16  # head lanes (of P) per program; 32 for the chunked kernel where N <= 64
_BLOCK_T = 32  # chunk length of the chunked kernel (tokens)
_CHUNKED_WARPS = 8


@triton.jit
def _program(
    cu_seqlens_ptr, state_slots_ptr, has_state_ptr, state_ptr, A_ptr, group, stride_ss,
    stride_sh, stride_sp, P: tl.constexpr, N: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """What a ``(sequence, head, P block)`` program of either kernel works on: its head, group,
    lanes and masks, its tokens ``start .. end``, ``A`` of its head, and its state slice held
    transposed, ``S^T [BLOCK_N, BLOCK_P]`` (pointers, mask, fp32 values; zeros for a fresh
    sequence)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    grp = head // group
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    p_mask, n_mask = offs_p < P, offs_n < N
    start = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    end = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64)
    slot = tl.load(state_slots_ptr + seq).to(tl.int64)
    # A fresh sequence reads no state: no lane of its slot is in range.
    lanes_in = tl.where(tl.load(has_state_ptr + seq) != 0, P, 0)
    s_ptrs = (
        state_ptr
        + slot * stride_ss
        + head * stride_sh
        + offs_n[:, None]
        + offs_p[None, :] * stride_sp
    )
    s_mask = n_mask[:, None] & p_mask[None, :]
    S = tl.load(s_ptrs, mask=n_mask[:, None] & (offs_p < lanes_in)[None, :], other=0.0)
    a_coef = tl.load(A_ptr + head).to(tl.float32)
    return head, grp, offs_p, p_mask, offs_n, n_mask, start, end, s_ptrs, s_mask, S, a_coef


@triton.jit
def _ssd_recurrent_kernel(
    x_ptr,
    dt_ptr,
    A_ptr,
    B_ptr,
    C_ptr,
    D_ptr,
    state_ptr,
    out_ptr,
    cu_seqlens_ptr,
    state_slots_ptr,
    has_state_ptr,
    group,
    stride_xt,
    stride_xh,
    stride_dt,
    stride_bt,
    stride_bg,
    stride_ct,
    stride_cg,
    stride_ot,
    stride_oh,
    stride_ss,
    stride_sh,
    stride_sp,
    P: tl.constexpr,
    N: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_D: tl.constexpr,
):
    head, grp, offs_p, p_mask, offs_n, n_mask, start, end, s_ptrs, s_mask, S, a_coef = _program(
        cu_seqlens_ptr, state_slots_ptr, has_state_ptr, state_ptr, A_ptr, group, stride_ss,
        stride_sh, stride_sp, P, N, BLOCK_P, BLOCK_N,
    )  # fmt: skip
    skip = 0.0
    if HAS_D:
        skip = tl.load(D_ptr + head).to(tl.float32)
    for t in range(start, end):
        x = tl.load(x_ptr + t * stride_xt + head * stride_xh + offs_p, mask=p_mask, other=0.0)
        x = x.to(tl.float32)
        b = tl.load(B_ptr + t * stride_bt + grp * stride_bg + offs_n, mask=n_mask, other=0.0)
        c = tl.load(C_ptr + t * stride_ct + grp * stride_cg + offs_n, mask=n_mask, other=0.0)
        dt = tl.load(dt_ptr + t * stride_dt + head).to(tl.float32)
        S = S * tl.exp(dt * a_coef) + b.to(tl.float32)[:, None] * (dt * x)[None, :]
        y = tl.sum(S * c.to(tl.float32)[:, None], axis=0) + skip * x
        tl.store(
            out_ptr + t * stride_ot + head * stride_oh + offs_p,
            y.to(out_ptr.dtype.element_ty),
            mask=p_mask,
        )
    tl.store(s_ptrs, S, mask=s_mask)


@triton.jit
def _ssd_chunked_kernel(
    x_ptr,
    dt_ptr,
    A_ptr,
    B_ptr,
    C_ptr,
    D_ptr,
    state_ptr,
    out_ptr,
    cu_seqlens_ptr,
    state_slots_ptr,
    has_state_ptr,
    group,
    stride_xt,
    stride_xh,
    stride_dt,
    stride_bt,
    stride_bg,
    stride_ct,
    stride_cg,
    stride_ot,
    stride_oh,
    stride_ss,
    stride_sh,
    stride_sp,
    P: tl.constexpr,
    N: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    head, grp, offs_p, p_mask, offs_n, n_mask, start, end, s_ptrs, s_mask, S, a_coef = _program(
        cu_seqlens_ptr, state_slots_ptr, has_state_ptr, state_ptr, A_ptr, group, stride_ss,
        stride_sh, stride_sp, P, N, BLOCK_P, BLOCK_N,
    )  # fmt: skip
    skip = 0.0
    if HAS_D:
        skip = tl.load(D_ptr + head).to(tl.float32)
    rows = tl.arange(0, BLOCK_T)
    causal = rows[:, None] >= rows[None, :]
    for c0 in range(start, end, BLOCK_T):
        t = c0 + rows
        t_mask = t < end
        xp_mask = t_mask[:, None] & p_mask[None, :]
        tn_mask = t_mask[:, None] & n_mask[None, :]
        bn_mask = n_mask[:, None] & t_mask[None, :]
        x = tl.load(
            x_ptr + t[:, None] * stride_xt + head * stride_xh + offs_p[None, :],
            mask=xp_mask,
            other=0.0,
        ).to(tl.float32)  # [BLOCK_T, BLOCK_P]
        b_t = tl.load(
            B_ptr + t[None, :] * stride_bt + grp * stride_bg + offs_n[:, None],
            mask=bn_mask,
            other=0.0,
        ).to(tl.float32)  # B^T [BLOCK_N, BLOCK_T]: every dot below takes its tiles as they are
        c = tl.load(
            C_ptr + t[:, None] * stride_ct + grp * stride_cg + offs_n[None, :],
            mask=tn_mask,
            other=0.0,
        ).to(tl.float32)  # [BLOCK_T, BLOCK_N]
        dt = tl.load(dt_ptr + t * stride_dt + head, mask=t_mask, other=0.0).to(tl.float32)
        cum = tl.cumsum(dt * a_coef, axis=0)  # running log decay, <= 0
        total = tl.sum(dt * a_coef, axis=0)
        # The chunk's own tokens: (C B^T) * exp(c_t - c_s) * dt_s, causal, times x.
        decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
        mix = tl.dot(c, b_t, input_precision=DOT_PRECISION) * decay * dt[None, :]
        y = tl.dot(mix, x, input_precision=DOT_PRECISION)
        # The carried state, decayed to each token: exp(c_t) (C S^T).
        y += tl.dot(c, S, input_precision=DOT_PRECISION) * tl.exp(cum)[:, None]
        y += skip * x
        tl.store(
            out_ptr + t[:, None] * stride_ot + head * stride_oh + offs_p[None, :],
            y.to(out_ptr.dtype.element_ty),
            mask=xp_mask,
        )
        weight = tl.exp(total - cum) * dt  # [BLOCK_T]
        S = S * tl.exp(total) + tl.dot(b_t, x * weight[:, None], input_precision=DOT_PRECISION)
    tl.store(s_ptrs, S, mask=s_mask)


def _check(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_slots: torch.Tensor,
    has_state: torch.Tensor,
) -> None:
    """``ValueError`` naming what the kernels cannot take (shapes, dtypes, layouts, devices)."""
    if x.dim() != 3 or B.dim() != 3 or state.dim() != 4:
        raise ValueError(
            f"x must be [T, H, P], B and C [T, G, N], state [slots, H, P, N]; got "
            f"{tuple(x.shape)}, {tuple(B.shape)}, {tuple(state.shape)}"
        )
    num_tokens, heads, p = x.shape
    groups, n = B.shape[1:]
    if C.shape != B.shape or B.shape[0] != num_tokens or heads % groups:
        raise ValueError(f"B {tuple(B.shape)} and C {tuple(C.shape)} do not fit x {tuple(x.shape)}")
    if tuple(state.shape[1:]) != (heads, p, n) or state.dtype != torch.float32:
        raise ValueError(
            f"state must be fp32 [slots, {heads}, {p}, {n}], got {state.dtype} {tuple(state.shape)}"
        )
    if dt.shape != (num_tokens, heads) or A.shape != (heads,):
        raise ValueError(f"dt must be [T, H] = {(num_tokens, heads)} and A [H] = ({heads},)")
    if D is not None and D.shape != (heads,):
        raise ValueError(f"D must be [H] = ({heads},), got {tuple(D.shape)}")
    num_seqs = state_slots.shape[0]
    if cu_seqlens.shape != (num_seqs + 1,) or has_state.shape != (num_seqs,):
        raise ValueError("cu_seqlens [S + 1], state_slots [S] and has_state [S] must agree")
    named = {"dt": dt, "A": A, "B": B, "C": C, "state": state, "cu_seqlens": cu_seqlens}
    for name, t in named.items() if D is None else {**named, "D": D}.items():
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x is on {x.device}")
    check_device(x.device)
    last = (x.stride(2), dt.stride(1), B.stride(2), C.stride(2))
    if any(s != 1 for s in last) or not state.is_contiguous():
        raise ValueError("x, dt, B and C need contiguous last dims, state contiguity")
    if not A.is_contiguous() or (D is not None and not D.is_contiguous()):
        raise ValueError("A and D must be contiguous")


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    state: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    state_slots: torch.Tensor,
    has_state: torch.Tensor,
    max_seqlen_q: int,
) -> torch.Tensor:
    """``y [T, H, P]`` (x's dtype) of Mamba-2's scan over the step's sequences, updating
    ``state [num_slots, H, P, N]`` (fp32, contiguous) in place.

    x ``[T, H, P]``; dt ``[T, H]`` fp32 (softplus'ed step sizes); A ``[H]`` fp32 (negative); B,
    C ``[T, G, N]`` (last dims contiguous; views of one projection are fine); D ``[H]`` or None;
    ``cu_seqlens [S + 1]``, ``state_slots [S]`` int32, ``has_state [S]``. The kernel:
    :func:`uses_chunked_kernel` of ``max_seqlen_q`` (host int, the longest sequence of the
    step) and the dtype."""
    _check(x, dt, A, B, C, D, state, cu_seqlens, state_slots, has_state)
    num_tokens, heads, p = x.shape
    groups, n = B.shape[1:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_seqs = state_slots.shape[0]
    if num_seqs == 0 or num_tokens == 0:
        return out
    args = (
        x,
        dt,
        A,
        B,
        C,
        A if D is None else D,  # never read without D
        state,
        out,
        cu_seqlens,
        state_slots,
        has_state,
        heads // groups,
        x.stride(0),
        x.stride(1),
        dt.stride(0),
        B.stride(0),
        B.stride(1),
        C.stride(0),
        C.stride(1),
        out.stride(0),
        out.stride(1),
        state.stride(0),
        state.stride(1),
        state.stride(2),
    )
    chunked = uses_chunked_kernel(max_seqlen_q, x.dtype, x.device)
    constants = ssd_constants(p, n, has_d=D is not None, chunked=chunked)
    grid = (num_seqs, heads, triton.cdiv(p, constants["BLOCK_P"]))
    kernel = _ssd_chunked_kernel if chunked else _ssd_recurrent_kernel
    kernel[grid](*args, **constants, num_warps=_CHUNKED_WARPS if chunked else 4)
    return out


def uses_chunked_kernel(max_seqlen_q: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a step runs the chunked kernel: any step with a prefill chunk, except fp32 ones on
    a GPU (whose exactness wants ``ieee`` dots; the recurrent kernel is exact and needs none).
    Interpreted, fp32 runs the chunked kernel."""
    if max_seqlen_q <= 1:
        return False
    return dtype != torch.float32 or device.type != "cuda"


def ssd_constants(p: int, n: int, *, has_d: bool, chunked: bool) -> dict[str, int | str | bool]:
    """The compile-time arguments of a launch: the whole state width N in one tile (``C B^T``
    sums over it), P split in ``BLOCK_P`` lanes; the chunked kernel's dots need every tile dim
    >= 16."""
    block_n = triton.next_power_of_2(n)
    block_p = min(triton.next_power_of_2(p), _BLOCK_P)
    constants: dict[str, int | str | bool] = dict(
        P=p, N=n, BLOCK_P=block_p, BLOCK_N=block_n, HAS_D=has_d
    )
    if chunked:
        wide = 2 * _BLOCK_P if block_n <= 64 else _BLOCK_P
        constants.update(
            BLOCK_P=max(16, min(triton.next_power_of_2(p), wide)),
            BLOCK_N=max(16, block_n),
            BLOCK_T=_BLOCK_T,
            DOT_PRECISION="tf32",
        )
    return constants
