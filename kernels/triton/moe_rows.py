"""What both fused-MoE GEMM kernels do with a block of routed pairs, before and after its
product (``kernels/triton/fused_moe.py`` over plain experts, ``quantized_moe.py`` over stored
quantized ones): which rows of ``a`` the block reads, and how its tile is finished and stored.

A block is ``BLOCK_M`` slots of the pairs sorted by expert (``align_pairs``); a slot holds a
pair id, or the sentinel ``num_pairs`` in the padding. The gate/up projection reads token
``pair // top_k``'s row of ``a`` (``A_PER_TOKEN``), the down projection the pair's own row.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def routed_rows(
    pair_ids_ptr, pid_m, num_pairs, top_k, A_PER_TOKEN: tl.constexpr, BLOCK_M: tl.constexpr
):
    """``(pair, valid, a_row)`` of block ``pid_m``: its slots' pair ids ``[BLOCK_M]`` (int64),
    which are pairs (not padding), and the row of ``a`` each reads."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_ids_ptr + offs_m).to(tl.int64)
    valid = pair < num_pairs
    if A_PER_TOKEN:
        a_row = pair // top_k
    else:
        a_row = pair
    return pair, valid, a_row


@triton.jit
def store_routed(
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
    HAS_BIAS: tl.constexpr,
    MUL_ROUTE: tl.constexpr,
):
    """The fp32 tile ``acc [BLOCK_M, BLOCK_N]`` plus the expert's bias, times each pair's
    routing weight (the down projection), stored to each pair's row of ``out``."""
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * stride_be + offs_n, mask=n_mask, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    if MUL_ROUTE:
        route = tl.load(route_ptr + pair, mask=valid, other=0.0)
        acc *= route.to(tl.float32)[:, None]
    tl.store(
        out_ptr + pair[:, None] * stride_om + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=valid[:, None] & n_mask[None, :],
    )
