"""The projections' CPU kernels: what ``F.linear`` leaves on the table, taken back exactly.

Decoding reads every weight once per step, so at a few rows a projection is a matrix-vector
product bounded by memory bandwidth, and the kernel torch picks for ``F.linear`` decides the
step time. Two swaps, each equal to ``F.linear`` on the same rows:

**fp32: split over the cores** (``CoreSplitLinear``). torch's fp32 ``F.linear`` (MKL) runs a
few-row product on one core whatever ``torch.set_num_threads`` says. Splitting the weight's
output rows into ``blocks`` contiguous blocks makes it a batched product,
``bmm(x expanded to [blocks, M, K], W viewed as [blocks, N/blocks, K] transposed)``, and torch's
CPU ``bmm`` hands one block to each thread::

    W [N, K] ──view──► [W₀ ; W₁]                 core 0: x @ W₀ᵀ ─┐
    (no copy: a view of the contiguous weight)   core 1: x @ W₁ᵀ ─┴─► [M, N]

Each output element is still one MKL dot product over the same ``K`` inputs in the same order:
at one row the result equals ``F.linear`` bit for bit, and at more rows it differs by the same
last-bit rounding that batching rows already causes in ``F.linear`` (MKL's kernel depends on the
row count). Above ``MAX_SPLIT_ROWS`` (prefill chunks) MKL's own threading is as good.

**bf16: weights packed once for oneDNN** (``PackedLinear``). bf16 ``F.linear`` goes to oneDNN,
which reorders the weight into its blocked layout on every call: a second pass over the weight
bytes. ``torch.ops.mkldnn._reorder_linear_weight`` does it once at load and
``_linear_pointwise`` multiplies by the packed weight; the result equals ``F.linear`` bit for
bit at every row count (tests). The packed copy replaces the weight (a tied LM head's packed
copy sits beside the embedding, which the lookup still reads).

Measured on this 2-core box, SmolLM2-135M's 30 layers of projections (docs/performance.md):
fp32 26 ms split against 38 ms plain at 1 row, 31 against 54 ms at 8 rows; bf16 11.5 ms packed
against 19 ms plain at 1 row, 12 against 23 ms at 8. The tests check greedy tokens against
Hugging Face for every supported family in both dtypes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.fused_projections import linear_from
from engine.linear_swap import swap_linears

MAX_SPLIT_ROWS = 256  # above this many rows the plain F.linear is as fast (measured at 512)


class CoreSplitLinear(nn.Module):
    """``y = x @ weight.T + bias`` for ``x [..., in_features]``, split over ``blocks`` cores.

    Holds the original ``weight [out, in]`` and ``bias [out]`` Parameters themselves (a tied LM
    head stays tied); ``out_features`` must be a multiple of ``blocks``.
    """

    def __init__(self, linear: nn.Linear, blocks: int):
        super().__init__()
        if blocks < 2 or linear.out_features % blocks:
            raise ValueError(f"cannot split {linear.out_features} outputs into {blocks} blocks")
        if not linear.weight.is_contiguous():
            raise ValueError("the weight must be contiguous to be viewed as row blocks")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.blocks = blocks
        self.weight = linear.weight
        self.bias = linear.bias
        per_block = self.out_features // blocks
        # Views of the Parameters themselves, taken once: [blocks, K, N/blocks] and [blocks, 1,
        # N/blocks] (plain attributes, so state_dict and the tie see only the Parameters).
        self._blocks_t = self.weight.detach().view(blocks, per_block, self.in_features).mT
        self._bias_blocks = None if self.bias is None else self.bias.detach().view(blocks, 1, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] > MAX_SPLIT_ROWS:
            return F.linear(x, self.weight, self.bias)
        batched = rows.expand(self.blocks, *rows.shape)
        if self._bias_blocks is None:
            y = torch.bmm(batched, self._blocks_t)
        else:
            y = torch.baddbmm(self._bias_blocks, batched, self._blocks_t)
        return y.transpose(0, 1).reshape(*x.shape[:-1], self.out_features)


class PackedLinear(nn.Module):
    """``y = x @ weight.T + bias`` for ``x [..., in_features]`` through oneDNN, with the weight
    packed once (bf16 on the CPU). Equal to ``F.linear`` bit for bit."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # An opaque oneDNN tensor, not a Parameter: nothing but this module can read it.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def _swap_for(linear: nn.Linear, blocks: int) -> nn.Module | None:
    """The faster module computing what ``linear`` does, or None to keep it."""
    if linear.weight.device.type != "cpu":
        return None
    dtype = linear.weight.dtype
    if dtype == torch.float32 and blocks > 1 and linear.out_features % blocks == 0:
        return CoreSplitLinear(linear, blocks) if linear.weight.is_contiguous() else None
    if dtype == torch.bfloat16 and torch.backends.mkldnn.is_available():
        return PackedLinear(linear)
    return None


@torch.no_grad()
def speed_up_cpu_linears(model: nn.Module) -> int:
    """Swap the decoder layers' and the LM head's CPU ``nn.Linear``s for their faster equals,
    in place: fp32 ones for ``CoreSplitLinear`` over ``torch.get_num_threads()`` blocks (none
    with one thread), bf16 ones for ``PackedLinear``. Returns how many were swapped; other
    dtypes, devices and module types are left alone."""
    blocks = torch.get_num_threads()
    return swap_linears(model, lambda linear: _swap_for(linear, blocks))


@torch.no_grad()
def restore_plain_linears(model: nn.Module) -> int:
    """Undo ``speed_up_cpu_linears`` in place, each swapped module back to a plain ``nn.Linear``
    with the same weights (tensor parallelism shards plain ones); returns how many."""
    count = 0
    for owner in list(model.modules()):
        for name, child in list(owner.named_children()):
            if isinstance(child, CoreSplitLinear):
                setattr(owner, name, linear_from(child.weight, child.bias))
            elif isinstance(child, PackedLinear):
                setattr(owner, name, linear_from(child.packed.to_dense(), child.bias))
            else:
                continue
            count += 1
    return count
