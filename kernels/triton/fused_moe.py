"""Fused mixture-of-experts: the routed (token, expert) pairs as two grouped GEMMs.

Semantics are those of :func:`paged_serve.kernels.reference.fused_moe_ref`: token ``t`` routed to
experts ``topk_ids[t, j]`` with weights ``topk_weights[t, j]`` gets
``sum_j w_tj * (gate(x_t @ W1[e]^T + b1[e]) @ W2[e]^T + b2[e])``.

Algorithm (the design of vLLM's and SGLang's ``fused_moe``)
----------------------------------------------------------
* ``align_pairs`` (torch, on the device, no host sync): the ``S = T * k`` pairs are sorted by
  expert and each expert's run padded to a multiple of ``BLOCK_M``; a block of ``BLOCK_M``
  sorted slots belongs to one expert (``block_experts``; -1 for the blocks past the last run).
  The slot count is the static bound ``S + E * (BLOCK_M - 1)``, so a CUDA graph can hold it.
  Padding slots hold the sentinel ``S`` and are masked.
* ``_moe_gemm_kernel``, once per projection: program ``(m, n)`` multiplies the rows of its block
  (``x[pair // k]`` for the gate/up projection, the pair's own row for the down projection) by
  its expert's weight tile ``[BLOCK_N, K]``, adds the expert's bias, and for the down
  projection multiplies by the pair's routing weight, then stores each pair's row. An expert
  no token chose gets no block and costs nothing.
* The gate between the two (SwiGLU, gpt-oss's clamped one) is the model's own ``apply_gate``;
  the ``k`` rows of each token are summed at the end.

Weights are ``[E, out, in]`` views (any strides: a checkpoint stored ``[E, in, out]`` is passed
transposed, without a copy), or experts stored quantized (``IntExperts``, ``Fp8Experts`` of
``kernels/interface.py``), whose projections run ``kernels/triton/quantized_moe.py``'s GEMM on
the same pairs, each weight tile dequantized inside the tile. Under the interpreter, bf16
operands are cast to fp32 before the dots (its bf16 ``tl.dot`` is wrong, as
``kernels/triton/paged_attention.py`` notes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

import triton
import triton.language as tl
from paged_serve.kernels.interface import ExpertWeights
from paged_serve.kernels.triton.moe_rows import routed_rows, store_routed
from paged_serve.kernels.triton.quantized_moe import quantized_moe_gemm
from paged_serve.kernels.triton.runtime import check_device, interpreting

BLOCK_M = 16  # pairs per block: the smallest tl.dot M, so a decode step pads little
BLOCK_N = 64
BLOCK_K = 64


@dataclass(frozen=True, slots=True)
class RoutedPairs:
    """The pairs sorted by expert: ``pair_ids [slots]`` int32 (sentinel ``num_pairs`` in the
    padding) and ``block_experts [slots / block_m]`` int32 (-1: no expert)."""

    pair_ids: torch.Tensor
    block_experts: torch.Tensor
    num_pairs: int
    top_k: int
    block_m: int


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> RoutedPairs:
    """Sort the ``[T, k]`` pairs by expert into blocks of ``block_m`` slots (see the module)."""
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    run_end = padded.cumsum(0)
    run_start = run_end - padded
    order = torch.sort(flat, stable=True).indices
    sorted_experts = flat[order]
    first_of_expert = counts.cumsum(0) - counts
    rank = torch.arange(num_pairs, device=device) - first_of_expert[sorted_experts]
    slots = -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m
    pair_ids = torch.full((slots,), num_pairs, dtype=torch.int32, device=device)
    pair_ids[run_start[sorted_experts] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, slots, block_m, device=device)
    owner = torch.searchsorted(run_end, block_start, right=True)
    block_experts = torch.where(owner < num_experts, owner, -1).to(torch.int32)
    return RoutedPairs(pair_ids, block_experts, num_pairs, top_k, block_m)


@triton.jit
def _moe_gemm_kernel(
    a_ptr,
    w_ptr,
    bias_ptr,
    route_ptr,
    out_ptr,
    pair_ids_ptr,
    block_experts_ptr,
    num_pairs,
    top_k,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_wk,
    stride_be,
    stride_om,
    A_PER_TOKEN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_ROUTE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    pair, valid, a_row = routed_rows(pair_ids_ptr, pid_m, num_pairs, top_k, A_PER_TOKEN, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(
            a_ptr + a_row[:, None] * stride_am + offs_k[None, :],
            mask=valid[:, None] & k_mask[None, :],
            other=0.0,
        )
        w = tl.load(
            w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
            mask=k_mask[:, None] & n_mask[None, :],
            other=0.0,
        )
        if DOT_FP32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    store_routed(
        acc,
        out_ptr,
        bias_ptr,
        route_ptr,
        expert,
        pair,
        valid,
        offs_n,
        n_mask,
        stride_be,
        stride_om,
        HAS_BIAS=HAS_BIAS,
        MUL_ROUTE=MUL_ROUTE,
    )


def moe_gemm(
    a: torch.Tensor,
    weight: torch.Tensor,
    pairs: RoutedPairs,
    *,
    per_token: bool,
    bias: torch.Tensor | None = None,
    route_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """One grouped GEMM: row ``p`` of the ``[S, out]`` result is ``a[p // k]`` (``per_token``)
    or ``a[p]`` times ``weight[e_p]^T`` (``weight [E, out, in]``, any strides), plus
    ``bias[e_p]`` (``[E, out]``), times ``route_weights[p]`` (``[S]``) when given."""
    check_device(a)
    if a.stride(-1) != 1:
        raise ValueError(f"a's last dim must be contiguous, got strides {a.stride()}")
    num_experts, n, k = weight.shape
    if a.shape[-1] != k:
        raise ValueError(f"a has {a.shape[-1]} features, the weights take {k}")
    if bias is not None and (bias.shape != (num_experts, n) or bias.stride(-1) != 1):
        raise ValueError(f"bias must be [{num_experts}, {n}] with contiguous rows")
    out = torch.empty(pairs.num_pairs, n, dtype=a.dtype, device=a.device)
    if pairs.num_pairs == 0:
        return out
    dot_fp32 = a.dtype == torch.bfloat16 and interpreting()
    grid = (pairs.block_experts.numel(), triton.cdiv(n, BLOCK_N))
    _moe_gemm_kernel[grid](
        a,
        weight,
        bias if bias is not None else out,
        route_weights.reshape(-1) if route_weights is not None else out,
        out,
        pairs.pair_ids,
        pairs.block_experts,
        pairs.num_pairs,
        pairs.top_k,
        n,
        k,
        a.stride(0),
        weight.stride(0),
        weight.stride(1),
        weight.stride(2),
        bias.stride(0) if bias is not None else 0,
        out.stride(0),
        A_PER_TOKEN=per_token,
        HAS_BIAS=bias is not None,
        MUL_ROUTE=route_weights is not None,
        DOT_FP32=dot_fp32,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 or dot_fp32 else "tf32",
        BLOCK_M=pairs.block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
    )
    return out


def _project(
    a: torch.Tensor, weight: torch.Tensor | ExpertWeights, pairs: RoutedPairs, **options
) -> torch.Tensor:
    """``moe_gemm`` for plain weights, ``quantized_moe_gemm`` for quantized experts."""
    if isinstance(weight, torch.Tensor):
        return moe_gemm(a, weight, pairs, **options)
    return quantized_moe_gemm(a, weight, pairs, **options)


def fused_moe(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor | ExpertWeights,
    w_down: torch.Tensor | ExpertWeights,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    apply_gate: Callable[[torch.Tensor], torch.Tensor],
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``hidden [T, H]`` through its routed experts: ``[T, H]`` in hidden's dtype.

    w_gate_up: ``[E, 2I, H]``; w_down: ``[E, H, I]`` (views of any strides, or quantized
    experts of those shapes: ``IntExperts``, ``Fp8Experts``); topk_ids,
    topk_weights: ``[T, k]``; ``apply_gate``: ``[S, 2I] -> [S, I]`` (the model's gate);
    biases ``[E, 2I]`` and ``[E, H]``. Never syncs with the host.
    """
    num_tokens, top_k = topk_ids.shape
    pairs = align_pairs(topk_ids, w_gate_up.shape[0])
    gate_up = _project(hidden.contiguous(), w_gate_up, pairs, per_token=True, bias=gate_up_bias)
    gated = apply_gate(gate_up).to(hidden.dtype).contiguous()
    weights = topk_weights.to(hidden.dtype).contiguous()
    down = _project(gated, w_down, pairs, per_token=False, bias=down_bias, route_weights=weights)
    return down.view(num_tokens, top_k, -1).sum(dim=1)
