"""The CPU's mixture-of-experts pass: only the routed (token, expert) pairs, grouped by expert.

The pairs are sorted by expert; each expert some token chose multiplies its run of rows in one
product per projection (bias included: ``F.linear``, or the ``linear`` of a packed or quantized
form, engine/platform/cpu/packed_experts.py, engine/model/int8_weights.py, int4_weights.py), the
model's gate between the two, the routing weights applied before the per-token sum. Experts nobody
chose cost nothing: a decode row of a top-2 model reads two experts' weights, not all of them.
(``torch._grouped_mm`` does the same in one call, but on the CPU it runs one GEMM per expert, chosen
or not: 16 GEMMs, 744 us a call at 16 experts, top-2 and 1 stream;
docs/measurements/model-families.md, "Mixture of experts".) The semantics are
``paged_serve.kernels.reference.fused_moe_ref``'s, which the Triton kernel also follows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F


class QuantizedExperts(Protocol):
    """An experts projection held in another form than a plain tensor: quantized
    (``Int8Experts``, ``Int4Experts`` of engine/model/int8_weights.py, int4_weights.py, under
    ``--quantization``) or packed (``PackedExperts``, fp32 on the CPU): ``[E, out, in]`` and
    expert ``e``'s product."""

    @property
    def shape(self) -> torch.Size: ...

    def linear(
        self, x: torch.Tensor, expert: int, bias: torch.Tensor | None = None
    ) -> torch.Tensor: ...


def grouped_moe(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor | QuantizedExperts,
    w_down: torch.Tensor | QuantizedExperts,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    apply_gate: Callable[[torch.Tensor], torch.Tensor],
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """As ``paged_serve.kernels.triton.fused_moe.fused_moe``: ``hidden [T, H]``, ``w_gate_up [E, 2I,
    H]``, ``w_down [E, H, I]`` (views, or ``QuantizedExperts`` under ``--quantization``),
    ``topk_ids``/``topk_weights [T, k]``; ``[T, H]``."""
    num_tokens, top_k = topk_ids.shape
    num_experts = w_gate_up.shape[0]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # a CPU tensor: no device sync
    x = hidden.index_select(0, order // top_k)
    route = topk_weights.reshape(-1).index_select(0, order).to(hidden.dtype)[:, None]
    pairs = torch.empty(order.numel(), w_down.shape[1], dtype=hidden.dtype)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:  # nobody chose it: it costs nothing
            continue
        rows = slice(start, start + count)
        start += count
        b1 = None if gate_up_bias is None else gate_up_bias[expert]
        b2 = None if down_bias is None else down_bias[expert]
        gated = apply_gate(_project(x[rows], w_gate_up, expert, b1)).to(hidden.dtype)
        pairs[rows] = _project(gated, w_down, expert, b2) * route[rows]
    out = torch.empty_like(pairs)
    out[order] = pairs
    return out.view(num_tokens, top_k, -1).sum(dim=1)


def _project(
    x: torch.Tensor, weight: torch.Tensor | QuantizedExperts, expert: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ W_e^T + bias`` for plain ``[E, out, in]`` weights or quantized ones."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight[expert], bias)
    return weight.linear(x, expert, bias)
