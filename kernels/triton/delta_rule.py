"""The gated delta rule over ragged sequences and per-sequence recurrent states (gated DeltaNet).

Semantics are exactly those of :func:`paged_serve.kernels.reference.gated_delta_rule_ref`: per value
head, with ``S [Dk, Dv]`` starting from ``state[slot]`` (zeros where ``has_state`` is 0) and q, k
L2-normalised (q scaled), each token does ``S = exp(g) S; S += k beta (v - k^T S); o = q^T S``,
and the final ``S`` goes back to the slot. Value head ``h`` reads key head ``h // (Hv // Hk)``.

Two kernels, one grid ``(S, Hv, cdiv(Dv, BLOCK_V))``; each program keeps its ``[Dk, BLOCK_V]``
slice of ``S`` in registers (fp32) for its whole sequence:

* **recurrent** (decode steps): the definition, one token at a time.
* **chunked** (any step with a prefill chunk; decode rows too): ``BLOCK_T`` tokens at a time in
  the WY form of the gated delta rule (the chunked algorithm of Yang et al., "Gated Delta
  Networks", as in flash-linear-attention). With ``G`` the in-chunk cumulative log decay,
  ``D[i, j] = exp(G_i - G_j)`` for ``j <= i`` and ``L`` the strictly lower part of
  ``(beta K) K^T * D``, the chunk's corrected values are ``U = (I + L)^-1 (beta V -
  beta K exp(G) S)``, its output ``exp(G) Q S + (Q K^T * D) U`` and the state
  ``exp(G_last) S + (K exp(G_last - G))^T U``. ``(I + L)^-1`` is formed without a solve: ``L`` is
  nilpotent, so ``(I + L)^-1 = (I - L)(I + L^2)(I + L^4)...``, ``log2(BLOCK_T)`` pairs of dots.
  Rows past the sequence's end load as zeros (k, v, beta, and g = 0), which makes them
  contribute nothing.

Math in fp32. The chunked kernel's dots run on TF32 tensor cores (``uses_chunked_kernel`` keeps
fp32 inputs on a GPU on the recurrent kernel); its tiles, ``BLOCK_T = 16`` tokens by
``BLOCK_V = 32`` value lanes over 8 warps, are the largest that build for 128-lane heads on
sm_90 without spills (ci/aot_compile.py).
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl
from paged_serve.kernels.triton.runtime import check_device

_BLOCK_V = 32
_BLOCK_T = 16  # chunk length of the chunked kernel (tokens)
_CHUNKED_WARPS = 8  # 4 warps spill at Qwen3-Next's 128-lane heads on sm_90


@triton.jit
def _load_normalised(ptrs, mask):
    """L2-normalised rows (one token's key-head vector, or a chunk's), fp32."""
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    return x * tl.rsqrt(tl.sum(x * x, axis=-1, keep_dims=True) + 1e-6)


@triton.jit
def _program(
    cu_seqlens_ptr, state_slots_ptr, has_state_ptr, state_ptr, group, stride_ss, stride_sh,
    stride_sk, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """What a ``(sequence, value head, value block)`` program of either kernel works on: its
    heads, lanes and masks, its tokens ``start .. end``, and its ``[Dk, BLOCK_V]`` state slice
    (pointers, mask, fp32 values; zeros for a fresh sequence)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    key_head = head // group
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_mask, v_mask = offs_k < DK, offs_v < DV
    start = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    end = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64)
    slot = tl.load(state_slots_ptr + seq).to(tl.int64)
    # A fresh sequence reads no state: no key row is in range.
    rows_in = tl.where(tl.load(has_state_ptr + seq) != 0, DK, 0)
    s_ptrs = (
        state_ptr
        + slot * stride_ss
        + head * stride_sh
        + offs_k[:, None] * stride_sk
        + offs_v[None, :]
    )
    s_mask = k_mask[:, None] & v_mask[None, :]
    S = tl.load(s_ptrs, mask=(offs_k < rows_in)[:, None] & v_mask[None, :], other=0.0)
    return head, key_head, offs_k, k_mask, offs_v, v_mask, start, end, s_ptrs, s_mask, S


@triton.jit
def _delta_rule_recurrent_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    out_ptr,
    cu_seqlens_ptr,
    state_slots_ptr,
    has_state_ptr,
    scale,
    group,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_ot,
    stride_oh,
    stride_ss,
    stride_sh,
    stride_sk,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    head, key_head, offs_k, k_mask, offs_v, v_mask, start, end, s_ptrs, s_mask, S = _program(
        cu_seqlens_ptr, state_slots_ptr, has_state_ptr, state_ptr, group, stride_ss, stride_sh,
        stride_sk, DK, DV, BLOCK_K, BLOCK_V,
    )  # fmt: skip
    for t in range(start, end):
        q = _load_normalised(q_ptr + t * stride_qt + key_head * stride_qh + offs_k, k_mask)
        k = _load_normalised(k_ptr + t * stride_kt + key_head * stride_kh + offs_k, k_mask)
        v = tl.load(v_ptr + t * stride_vt + head * stride_vh + offs_v, mask=v_mask, other=0.0)
        decay = tl.exp(tl.load(g_ptr + t * stride_gt + head).to(tl.float32))
        beta = tl.load(beta_ptr + t * stride_gt + head).to(tl.float32)
        S = S * decay
        delta = (v.to(tl.float32) - tl.sum(S * k[:, None], axis=0)) * beta
        S = S + k[:, None] * delta[None, :]
        o = tl.sum(S * (q * scale)[:, None], axis=0)
        tl.store(
            out_ptr + t * stride_ot + head * stride_oh + offs_v,
            o.to(out_ptr.dtype.element_ty),
            mask=v_mask,
        )
    tl.store(s_ptrs, S, mask=s_mask)


@triton.jit
def _delta_rule_chunked_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    out_ptr,
    cu_seqlens_ptr,
    state_slots_ptr,
    has_state_ptr,
    scale,
    group,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_ot,
    stride_oh,
    stride_ss,
    stride_sh,
    stride_sk,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_T: tl.constexpr,
    DOUBLINGS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    head, key_head, offs_k, k_mask, offs_v, v_mask, start, end, s_ptrs, s_mask, S = _program(
        cu_seqlens_ptr, state_slots_ptr, has_state_ptr, state_ptr, group, stride_ss, stride_sh,
        stride_sk, DK, DV, BLOCK_K, BLOCK_V,
    )  # fmt: skip
    rows = tl.arange(0, BLOCK_T)
    lower = rows[:, None] > rows[None, :]
    causal = rows[:, None] >= rows[None, :]
    eye = (rows[:, None] == rows[None, :]).to(tl.float32)
    for c0 in range(start, end, BLOCK_T):
        t = c0 + rows
        t_mask = t < end
        qk_mask = t_mask[:, None] & k_mask[None, :]
        q_rows = q_ptr + key_head * stride_qh + t[:, None] * stride_qt + offs_k[None, :]
        k_rows = k_ptr + key_head * stride_kh + t[:, None] * stride_kt + offs_k[None, :]
        q = _load_normalised(q_rows, qk_mask) * scale
        k = _load_normalised(k_rows, qk_mask)
        v = tl.load(
            v_ptr + t[:, None] * stride_vt + head * stride_vh + offs_v[None, :],
            mask=t_mask[:, None] & v_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        g = tl.load(g_ptr + t * stride_gt + head, mask=t_mask, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + t * stride_gt + head, mask=t_mask, other=0.0).to(tl.float32)
        G = tl.cumsum(g, axis=0)
        g_last = tl.sum(g, axis=0)
        decay = tl.exp(tl.where(causal, G[:, None] - G[None, :], float("-inf")))
        k_beta = k * beta[:, None]
        L = tl.where(lower, tl.dot(k_beta, tl.trans(k), input_precision=DOT_PRECISION) * decay, 0.0)
        # (I + L)^-1 = (I - L)(I + L^2)(I + L^4)...: L is strictly lower, L^BLOCK_T = 0.
        inv = eye - L
        power = L
        for _ in tl.static_range(DOUBLINGS):
            power = tl.dot(power, power, input_precision=DOT_PRECISION)
            inv = inv + tl.dot(inv, power, input_precision=DOT_PRECISION)
        # U = (I + L)^-1 (beta V - beta K exp(G) S): the part of V the carried state predicts
        # is taken out before the solve.
        carried = tl.dot(k_beta * tl.exp(G)[:, None], S, input_precision=DOT_PRECISION)
        u = tl.dot(inv, v * beta[:, None] - carried, input_precision=DOT_PRECISION)
        attn = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * decay
        o = tl.dot(q * tl.exp(G)[:, None], S, input_precision=DOT_PRECISION)
        o += tl.dot(attn, u, input_precision=DOT_PRECISION)
        tl.store(
            out_ptr + t[:, None] * stride_ot + head * stride_oh + offs_v[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=t_mask[:, None] & v_mask[None, :],
        )
        k_tail = k * tl.exp(g_last - G)[:, None]
        S = S * tl.exp(g_last) + tl.dot(tl.trans(k_tail), u, input_precision=DOT_PRECISION)
    tl.store(s_ptrs, S, mask=s_mask)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    state_slots: torch.Tensor,
    has_state: torch.Tensor,
    max_seqlen_q: int,
    scale: float | None = None,
    chunked: bool | None = None,
) -> torch.Tensor:
    """``o [T, Hv, Dv]`` (v's dtype) of the gated delta rule over the step's sequences, updating
    ``state [num_slots, Hv, Dk, Dv]`` (fp32, contiguous) in place.

    q, k ``[T, Hk, Dk]``, v ``[T, Hv, Dv]`` (last dims contiguous; views of one projection are
    fine); g, beta ``[T, Hv]`` fp32 with the same token stride; ``cu_seqlens [S + 1]``,
    ``state_slots [S]`` int32, ``has_state [S]``. The kernel: ``chunked`` if given, else
    :func:`uses_chunked_kernel` of ``max_seqlen_q`` (host int) and the dtype."""
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or state.dim() != 4:
        raise ValueError(
            f"q, k must be [T, Hk, Dk], v [T, Hv, Dv], state [slots, Hv, Dk, Dv]; got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}, {tuple(state.shape)}"
        )
    num_tokens, num_k, dk = q.shape
    num_v, dv = v.shape[1:]
    if v.shape[0] != num_tokens or num_v % num_k:
        raise ValueError(f"v {tuple(v.shape)} does not fit q {tuple(q.shape)}")
    if tuple(state.shape[1:]) != (num_v, dk, dv) or state.dtype != torch.float32:
        raise ValueError(
            f"state must be fp32 [slots, {num_v}, {dk}, {dv}], got {state.dtype} "
            f"{tuple(state.shape)}"
        )
    if g.shape != (num_tokens, num_v) or beta.shape != g.shape or beta.stride() != g.stride():
        raise ValueError(f"g and beta must be [T, Hv] = {(num_tokens, num_v)} with one layout")
    num_seqs = state_slots.shape[0]
    if cu_seqlens.shape != (num_seqs + 1,) or has_state.shape != (num_seqs,):
        raise ValueError("cu_seqlens [S + 1], state_slots [S] and has_state [S] must agree")
    for name, t in (("k", k), ("v", v), ("g", g), ("state", state), ("cu_seqlens", cu_seqlens)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q is on {q.device}")
    check_device(q.device)
    if min(q.stride(2), k.stride(2), v.stride(2), g.stride(1)) != 1 or not state.is_contiguous():
        raise ValueError("q, k, v, g and beta need contiguous last dims, state contiguity")
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if num_seqs == 0 or num_tokens == 0:
        return out
    args = (
        q,
        k,
        v,
        g,
        beta,
        state,
        out,
        cu_seqlens,
        state_slots,
        has_state,
        dk**-0.5 if scale is None else scale,
        num_v // num_k,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        out.stride(0),
        out.stride(1),
        state.stride(0),
        state.stride(1),
        state.stride(2),
    )
    if chunked is None:
        chunked = uses_chunked_kernel(max_seqlen_q, v.dtype, q.device)
    constants = delta_rule_constants(dk, dv, chunked=chunked)
    grid = (num_seqs, num_v, triton.cdiv(dv, constants["BLOCK_V"]))
    kernel = _delta_rule_chunked_kernel if chunked else _delta_rule_recurrent_kernel
    kernel[grid](*args, **constants, num_warps=_CHUNKED_WARPS if chunked else 4)
    return out


def uses_chunked_kernel(max_seqlen_q: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a step runs the chunked kernel: any step with a prefill chunk, except fp32 ones on
    a GPU. The chunked kernel's dots take TF32 tensor cores; fp32 inputs (exactness runs) want
    ``ieee`` dots, whose FMA tiles spill on sm_90 (ci/aot_compile.py), so they take the
    recurrent kernel there, exact and spill-free. Interpreted, fp32 runs the chunked kernel."""
    if max_seqlen_q <= 1:
        return False
    return dtype != torch.float32 or device.type != "cuda"


def delta_rule_constants(dk: int, dv: int, *, chunked: bool) -> dict[str, int | str]:
    """The compile-time arguments of a launch (ci/aot_compile.py builds the same): the chunked
    kernel's dots need every tile dim >= 16."""
    block_v = min(triton.next_power_of_2(dv), _BLOCK_V)
    constants = dict(DK=dk, DV=dv, BLOCK_K=max(16, triton.next_power_of_2(dk)), BLOCK_V=block_v)
    if chunked:
        constants.update(
            BLOCK_V=max(16, block_v),
            BLOCK_T=_BLOCK_T,
            DOUBLINGS=_BLOCK_T.bit_length() - 2,
            DOT_PRECISION="tf32",
        )
    return constants
