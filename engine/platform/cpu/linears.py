"""The projections' CPU kernels: what ``F.linear`` leaves on the table, taken back.

Decoding reads every weight once per step, so at a few rows a projection is a matrix-vector
product bounded by memory bandwidth, and the kernel torch picks for ``F.linear`` decides the
step time. Two swaps, each computing what ``F.linear`` computes (bf16 bit for bit, fp32 up to
the order of its sums):

**fp32: few rows split over the cores, more rows on a packed copy** (``CoreSplitLinear``).
torch's fp32 ``F.linear`` (MKL) runs a few-row product on one core whatever
``torch.set_num_threads`` says. Up to ``MAX_COLUMN_ROWS`` rows (decode steps of a few
sequences) the weight's output rows are split into ``blocks`` contiguous blocks, one per
thread of torch's CPU ``bmm``, and each block multiplies the inputs as columns::

    W [N, K] ──view──► [W₀ ; W₁]                 core 0: W₀ @ xᵀ ─┐
    (no copy: a view of the contiguous weight)   core 1: W₁ @ xᵀ ─┴─► [M, N]

``bmm(W viewed as [blocks, N/blocks, K], x expanded and transposed to [blocks, K, M])`` streams
the weight rows at about twice the rate of the row-major ``bmm(x, Wᵀ)`` (30 layers of
SmolLM2-135M at 1 row: 12.5-17.6 ms against 19.5-26.6 ms, 34 against 19 GB/s; an engine decode
step at 1, 2 and 3 streams: 29.7, 48.9 and 54.2 ms against 37.1, 58.2 and 68.6), but loses from
4 rows. Its ``[blocks, N/blocks, M]`` result is laid out densely as ``[M, N]`` (a copy of the
output: the Triton kernels and the row-parallel all-reduce read rows in memory order).

More rows (decode batches, prefill chunks) go to oneDNN on a copy of the weight packed once at
load into its blocked layout, which beats MKL from 4 rows (30 layers at 8 rows: 21.6 against
35.6 ms; the LM head at 8 rows: 5.2 against 12.2 ms; a 128-token chunk: 157 against 283 ms for
``F.linear``, 512 tokens: 550 against 727 ms; about even at 2048). The cost is memory: fp32
projections are held twice (the plain weight for the columns, the packed copy for the rest).

Every output element is still an fp32 dot product over the same ``K`` inputs; only the order of
its partial sums differs from ``F.linear``'s, as it already differs in ``F.linear`` between row
counts. So the outputs stay within fp32's rounding bound of the exact product, as
``F.linear``'s do (tests), and the greedy tokens still equal Hugging Face's (tests, and the
benchmarks' checks on the default model).

**bf16: weights packed once for oneDNN** (``PackedLinear``). bf16 ``F.linear`` goes to oneDNN,
which reorders the weight into its blocked layout on every call: a second pass over the weight
bytes. ``torch.ops.mkldnn._reorder_linear_weight`` does it once at load and
``_linear_pointwise`` multiplies by the packed weight; the result equals ``F.linear`` bit for
bit at every row count (tests). The packed copy replaces the weight (a tied LM head's packed
copy sits beside the embedding, which the lookup still reads).

Measured on this 2-core box, SmolLM2-135M's 30 layers of projections (docs/performance.md):
bf16 11.5 ms packed against 19 ms plain at 1 row, 12 against 23 ms at 8. The tests check greedy
tokens against Hugging Face for every supported family in both dtypes.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.fused_projections import linear_from
from engine.model.linear_swap import swap_linears
from engine.model.packed_weights import PackedWeights, pack

MAX_COLUMN_ROWS = 3  # up to this many rows, W @ xᵀ per block; more: oneDNN (measured)
PACKED_ROWS_HINT = 8  # the row count oneDNN lays the fp32 copy out for (best of 1, 8, 64)


class CoreSplitLinear(nn.Module):
    """``y = x @ weight.T + bias`` for ``x [..., in_features]`` in fp32: up to
    ``MAX_COLUMN_ROWS`` rows split over ``blocks`` cores, more rows through oneDNN.

    Holds the original ``weight [out, in]`` and ``bias [out]`` Parameters themselves (a tied LM
    head stays tied) and an opaque packed copy of the weight; ``out_features`` must be a
    multiple of ``blocks``.
    """

    DERIVED = ("_blocks", "_bias_blocks", "_packed")  # from the Parameters: not copied

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
        self._derive()

    def _derive(self) -> None:
        """Views of the Parameters themselves (plain attributes, so state_dict and the tie see
        only the Parameters): [blocks, N/blocks, K], the bias [blocks, N/blocks, 1]; and the
        packed copy."""
        self._blocks = self.weight.detach().view(self.blocks, -1, self.in_features)
        bias = self.bias
        self._bias_blocks = None if bias is None else bias.detach().view(self.blocks, -1, 1)
        self._packed = pack(self.weight, PACKED_ROWS_HINT)

    def __getstate__(self) -> dict[str, object]:
        """Deep copies and pickles carry the Parameters only (the packed copy is opaque to
        both, and a copied view would no longer view the copied weight)."""
        return {k: v for k, v in self.__dict__.items() if k not in self.DERIVED}

    def __setstate__(self, state: dict[str, object]) -> None:
        super().__setstate__(state)
        self._derive()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] > MAX_COLUMN_ROWS:
            y = torch.ops.mkldnn._linear_pointwise(rows, self._packed, self.bias, "none", [], "")
            return y.view(*x.shape[:-1], self.out_features)
        columns = rows.expand(self.blocks, *rows.shape).mT  # [blocks, K, M], no copy
        if self._bias_blocks is None:
            y = torch.bmm(self._blocks, columns)
        else:
            y = torch.baddbmm(self._bias_blocks, self._blocks, columns)
        # [blocks, N/blocks, M] -> [M, N], laid out densely: consumers (the Triton kernels, an
        # all-reduce) read rows in memory order.
        return y.permute(2, 0, 1).reshape(*x.shape[:-1], self.out_features).contiguous()


class PackedLinear(PackedWeights, nn.Module):
    """``y = x @ weight.T + bias`` for ``x [..., in_features]`` through oneDNN, with the weight
    packed once (bf16 on the CPU). Equal to ``F.linear`` bit for bit."""

    PACKED = ("packed",)
    PACKED_ROWS = 1

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # An opaque oneDNN tensor, not a Parameter: nothing but this module can read it.
        self.packed = pack(linear.weight, self.PACKED_ROWS)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def _swap_for(linear: nn.Linear, blocks: int) -> nn.Module | None:
    """The faster module computing what ``linear`` does, or None to keep it."""
    if linear.weight.device.type != "cpu":
        return None
    dtype = linear.weight.dtype
    if not torch.backends.mkldnn.is_available():
        return None
    if dtype == torch.float32 and blocks > 1 and linear.out_features % blocks == 0:
        return CoreSplitLinear(linear, blocks) if linear.weight.is_contiguous() else None
    if dtype == torch.bfloat16:
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
