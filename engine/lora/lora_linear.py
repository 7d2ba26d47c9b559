"""A projection plus each token's LoRA adapter: ``y = base(x) + B_s (A_s x)`` for the slot ``s``
of the token's adapter, in one pass over a batch mixing adapters.

Every adaptable projection of the decoder layers is wrapped once at load, after every other
rewrite (fusing, quantizing, sharding, the CPU kernels), so ``base`` is whatever computes the
projection, and the wrapper holds the adapter slots' matrices::

    lora_a [max_loras, parts * max_rank, in_features]    A of each part, rank lanes padded
    lora_b [max_loras, parts * max_rank, out_features]   scaling * B^T, each part's lanes
                                                          writing only that part's outputs

A fused projection (our ``qkv_proj`` of q, k and v, ``gate_up_proj``) is one wrapper of several
parts: an adapter's ``q_proj`` matrices fill part 0's lanes, ``k_proj``'s part 1's, and so on;
lanes of a rank below ``max_rank`` and parts the adapter leaves alone stay zero, which add
exactly nothing. Under tensor parallelism a column-parallel projection holds its rank's rows of
``B`` (``A`` whole), and a row-parallel one (inside ``RowParallelLinear``, before the
all-reduce) its rank's columns of ``A`` (``B`` whole): the partial products sum to the whole
adapter's in the all-reduce, as the base's do.

The step's ``LoRAStep`` (in the attention context) says which slot each token uses; the kernel
backend's ``add_lora`` adds the products (the CPU's grouped GEMMs or the Triton kernels). A
step without adapters costs one attribute read per projection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from paged_serve.engine.kv.attention_context import active_attention_context


@dataclass(frozen=True, slots=True)
class Shard:
    """How a wrapped projection is split over tensor-parallel ranks: ``rows`` (column-parallel,
    this rank's output rows) or ``columns`` (row-parallel, its input columns)."""

    kind: str
    rank: int
    world_size: int


class LoRALinear(nn.Module):
    """``base`` plus the adapter of each token's slot; ``sizes``: the output features of each
    part (one for a plain projection), local to this rank."""

    def __init__(
        self,
        base: nn.Module,
        sizes: tuple[int, ...],
        *,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        shard: Shard | None = None,
    ):
        super().__init__()
        self.base = base
        self.in_features = int(base.in_features)
        self.out_features = int(base.out_features)
        if sum(sizes) != self.out_features:
            raise ValueError(f"parts {sizes} do not add up to {self.out_features} outputs")
        self.sizes = sizes
        self.max_rank = max_rank
        self.shard = shard
        lanes = len(sizes) * max_rank
        device = _device_of(base)
        self.register_buffer(
            "lora_a",
            torch.zeros(max_loras, lanes, self.in_features, dtype=dtype, device=device),
            persistent=False,
        )
        self.register_buffer(
            "lora_b",
            torch.zeros(max_loras, lanes, self.out_features, dtype=dtype, device=device),
            persistent=False,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        ctx = active_attention_context()
        step = None if ctx is None else ctx.lora
        if step is None:
            return y
        y = y.contiguous()
        ctx.backend.add_lora(
            x.reshape(-1, self.in_features),
            y.view(-1, self.out_features),
            self.lora_a,
            self.lora_b,
            step.token_slots,
            step.first_slot,
            step.num_slots,
            step.mask,
            step.segments,
        )
        return y

    def full_shape(self, part: int) -> tuple[int, int]:
        """Part ``part``'s whole (unsharded) ``(in_features, out_features)``."""
        inputs, outputs = self.in_features, self.sizes[part]
        if self.shard is not None and self.shard.kind == "rows":
            outputs *= self.shard.world_size
        elif self.shard is not None:
            inputs *= self.shard.world_size
        return inputs, outputs

    @torch.no_grad()
    def fill(self, slot: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot ``slot`` holds ``parts``: by part index, the whole ``(A [r, in], scaling * B
        [out, r])`` (this rank's share is taken here); parts not named hold nothing."""
        a, b = self.lora_a[slot], self.lora_b[slot]
        a.zero_()
        b.zero_()
        offsets = [0]
        for size in self.sizes:
            offsets.append(offsets[-1] + size)
        for part, (lora_a, lora_b) in parts.items():
            lora_a, lora_b = self._local(lora_a, lora_b)
            rank = lora_a.shape[0]
            lane = part * self.max_rank
            a[lane : lane + rank].copy_(lora_a)
            b[lane : lane + rank, offsets[part] : offsets[part + 1]].copy_(lora_b.t())

    def _local(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of a whole adapter part."""
        shard = self.shard
        if shard is None:
            return a, b
        if shard.kind == "rows":
            n = b.shape[0] // shard.world_size
            return a, b[shard.rank * n : (shard.rank + 1) * n]
        n = a.shape[1] // shard.world_size
        return a[:, shard.rank * n : (shard.rank + 1) * n], b

    def extra_repr(self) -> str:
        slots, lanes, _ = self.lora_a.shape
        return f"parts={list(self.sizes)}, slots={slots}, lanes={lanes}"


def _device_of(module: nn.Module) -> torch.device:
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return torch.device("cpu")
