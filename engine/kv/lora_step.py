"""One step's adapters: which slot each token's adapter is in, as the projections read it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class LoRAStep:
    """``token_slots [T]`` int32: each token's adapter slot, -1 for the base model alone (the
    Triton kernels read it). The CPU path reads the host-side range of slots the step uses,
    ``first_slot .. first_slot + num_slots - 1``, and ``mask [T, num_slots, 1]`` (1 where the
    token's slot is that one, in the model's dtype), None when every token is in the one slot
    of the range."""

    token_slots: torch.Tensor
    first_slot: int
    num_slots: int
    mask: torch.Tensor | None


def lora_step(
    token_slots: Sequence[int], dtype: torch.dtype, device: torch.device
) -> LoRAStep | None:
    """The step's ``LoRAStep`` from each token's slot (-1: none); None when no token has an
    adapter (the projections then skip the adapters entirely)."""
    used = sorted({s for s in token_slots if s >= 0})
    if not used:
        return None
    first, count = used[0], used[-1] - used[0] + 1
    slots = torch.tensor(token_slots, dtype=torch.int32)
    mask = None
    if count > 1 or len(used) != 1 or min(token_slots) < 0:
        lanes = torch.arange(first, first + count, dtype=torch.int32)
        mask = (slots[:, None] == lanes[None, :]).to(dtype)[:, :, None]
        mask = mask.to(device)
    return LoRAStep(slots.to(device), first, count, mask)
