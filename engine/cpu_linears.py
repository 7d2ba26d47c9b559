"""The projections' CPU kernels: what ``F.linear`` leaves on the table, taken back exactly.

Decoding reads every weight once per step, so at a few rows a projection is a matrix-vector
product bounded by memory bandwidth, and the kernel torch picks for ``F.linear`` decides the
step time. Two swaps, each equal to ``F.linear`` on the same rows:

**fp32: split over the cores** (``CoreSplitLinear``). torch's fp32 ``F.linear`` (MKL) runs a
few-row product on one core whatever ``torch.set_num_threads`` says. Splitting the weight's
output rows into ``blocks`` contiguous blocks makes it a batched product, and torch's CPU
``bmm`` hands one block to each thread::

    W [N, K] ──view──► [W₀ ; W₁]                 core 0: W₀ @ xᵀ ─┐
    (no copy: a view of the contiguous weight)   core 1: W₁ @ xᵀ ─┴─► [M, N]

Up to ``MAX_COLUMN_ROWS`` rows (decode steps of a few sequences) each block multiplies the
inputs as columns, ``bmm(W viewed as [blocks, N/blocks, K], x expanded and transposed to
[blocks, K, M])``: MKL then streams the weight rows at about twice the rate of the row-major
product (30 layers of SmolLM2-135M at 1 row: 12.5-17.6 ms against 19.5-26.6 ms for ``bmm(x,
Wᵀ)``, 34 against 19 GB/s; a whole fp32 decode step of the engine at 1, 2 and 3 streams: 29.7,
48.9 and 54.2 ms against 37.1, 58.2 and 68.6, but 69.1 against 51.8-59.2 at 4). More rows use
``bmm(x expanded to [blocks, M, K], W viewed and transposed)``, and above ``MAX_SPLIT_ROWS``
(prefill chunks) MKL's own threading is as good. Every output element is still one fp32 dot
product over the same ``K`` inputs; only the order of its partial sums differs from
``F.linear``'s, as it already differs in ``F.linear`` between row counts, so outputs differ from
``F.linear``'s in the last bits (the same size of error against fp64) and the greedy tokens
still equal Hugging Face's (tests, and the benchmarks' checks on the default model).

**bf16: weights packed once for oneDNN** (``PackedLinear``). bf16 ``F.linear`` goes to oneDNN,
which reorders the weight into its blocked layout on every call: a second pass over the weight
bytes. ``torch.ops.mkldnn._reorder_linear_weight`` does it once at load and
``_linear_pointwise`` multiplies by the packed weight; the result equals ``F.linear`` bit for
bit at every row count (tests). The packed copy replaces the weight (a tied LM head's packed
copy sits beside the embedding, which the lookup still reads).

Measured on this 2-core box, SmolLM2-135M's 30 layers of projections (docs/performance.md):
fp32 26 ms split row-major against 38 ms plain at 1 row, 31 against 54 ms at 8 rows; bf16
11.5 ms packed against 19 ms plain at 1 row, 12 against 23 ms at 8. The tests check greedy
tokens against Hugging Face for every supported family in both dtypes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.fused_projections import linear_from
from engine.linear_swap import swap_linears

MAX_COLUMN_ROWS = 3  # up to this many rows, W @ xᵀ per block (faster to 3 rows: measured)
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
        # Views of the Parameters themselves, taken once (plain attributes, so state_dict and
        # the tie see only the Parameters): [blocks, N/blocks, K] and its transpose, and the
        # bias as [blocks, N/blocks, 1] and [blocks, 1, N/blocks].
        self._blocks = self.weight.detach().view(blocks, per_block, self.in_features)
        self._blocks_t = self._blocks.mT
        bias = None if self.bias is None else self.bias.detach().view(blocks, per_block, 1)
        self._bias_columns = bias
        self._bias_rows = None if bias is None else bias.mT

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        count = rows.shape[0]
        if count > MAX_SPLIT_ROWS:
            return F.linear(x, self.weight, self.bias)
        batched = rows.expand(self.blocks, *rows.shape)  # [blocks, M, K], no copy
        if count <= MAX_COLUMN_ROWS:  # [blocks, N/blocks, M]
            columns = batched.mT
            if self._bias_columns is None:
                y = torch.bmm(self._blocks, columns)
            else:
                y = torch.baddbmm(self._bias_columns, self._blocks, columns)
            y = y.permute(2, 0, 1)
        elif self._bias_rows is None:  # [blocks, M, N/blocks]
            y = torch.bmm(batched, self._blocks_t).transpose(0, 1)
        else:
            y = torch.baddbmm(self._bias_rows, batched, self._blocks_t).transpose(0, 1)
        return y.reshape(*x.shape[:-1], self.out_features)


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
