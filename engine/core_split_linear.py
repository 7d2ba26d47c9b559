"""fp32 projections on every CPU core: one batched GEMM over row blocks of the weight.

Decoding reads every weight once per step, so at a few rows a projection is a matrix-vector
product bounded by memory bandwidth. torch's fp32 ``F.linear`` on the CPU (MKL) runs such a
product on one core whatever ``torch.set_num_threads`` says: the second core idles. Splitting
the weight's output rows into ``blocks`` contiguous blocks makes the same product a batched one,
``bmm(x expanded to [blocks, M, K], W viewed as [blocks, N/blocks, K] transposed)``, and torch's
CPU ``bmm`` hands one block to each thread::

    W [N, K] ──view──► [W₀ ; W₁]        core 0: x @ W₀ᵀ ─┐
    (no copy: a view of the contiguous weight)   core 1: x @ W₁ᵀ ─┴─► [M, N]

Each output element is still one MKL dot product over the same ``K`` inputs in the same order:
at one row the result equals ``F.linear`` bit for bit, and at more rows it differs by the same
last-bit rounding that batching rows already causes in ``F.linear`` (MKL's kernel depends on the
row count). The tests check greedy tokens against Hugging Face for every supported family.

Measured on this 2-core box (docs/performance.md): SmolLM2-135M's 30 layers of projections at
1 row take 26 ms split against 38 ms in ``F.linear``, and 31 against 54 ms at 8 rows. Above
``MAX_SPLIT_ROWS`` (prefill chunks) MKL's own threading is as good, so the plain call runs.
Only fp32 is split: bf16 and int8 go through oneDNN kernels that already use every core.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.fused_projections import linear_from

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
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.blocks = blocks
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        count = rows.shape[0]
        if count > MAX_SPLIT_ROWS or not self.weight.is_contiguous():
            return F.linear(x, self.weight, self.bias)
        per_block = self.out_features // self.blocks
        weight_t = self.weight.view(self.blocks, per_block, self.in_features).transpose(1, 2)
        batched = rows.expand(self.blocks, count, self.in_features)
        if self.bias is None:
            y = torch.bmm(batched, weight_t)
        else:
            y = torch.baddbmm(self.bias.view(self.blocks, 1, per_block), batched, weight_t)
        return y.transpose(0, 1).reshape(*x.shape[:-1], self.out_features)


def _splittable(module: nn.Module, blocks: int) -> bool:
    return (
        type(module) is nn.Linear
        and module.weight.dtype == torch.float32
        and module.weight.device.type == "cpu"
        and module.out_features % blocks == 0
    )


def _swap(module: nn.Module, blocks: int) -> int:
    count = 0
    for name, child in module.named_children():
        if _splittable(child, blocks):
            setattr(module, name, CoreSplitLinear(child, blocks))
            count += 1
        else:
            count += _swap(child, blocks)
    return count


@torch.no_grad()
def split_across_cores(model: nn.Module) -> int:
    """Swap the decoder layers' and the LM head's fp32 CPU ``nn.Linear``s for
    ``CoreSplitLinear`` over ``torch.get_num_threads()`` blocks, in place; returns how many were
    swapped (none with one thread). Other dtypes, devices and module types are left alone."""
    blocks = torch.get_num_threads()
    if blocks < 2:
        return 0
    count = _swap(model.model.layers, blocks)
    if _splittable(model.get_output_embeddings(), blocks):
        model.lm_head = CoreSplitLinear(model.get_output_embeddings(), blocks)
        count += 1
    return count


@torch.no_grad()
def join_cores(model: nn.Module) -> int:
    """Undo ``split_across_cores`` in place (tensor parallelism shards plain ``nn.Linear``s);
    returns how many modules were put back."""
    count = 0
    for owner in list(model.modules()):
        for name, child in list(owner.named_children()):
            if isinstance(child, CoreSplitLinear):
                setattr(owner, name, linear_from(child.weight, child.bias))
                count += 1
    return count
