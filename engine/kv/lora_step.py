"""One step's adapters: which slot each token's adapter is in, as the projections read it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from paged_serve.kernels.interface import LoraSegments


@dataclass(frozen=True, slots=True)
class LoRAStep:
    """``token_slots [T]`` int32: each token's adapter slot, -1 for the base model alone (the
    Triton kernels read it). The CPU path reads the host-side range of slots the step uses,
    ``first_slot .. first_slot + num_slots - 1``, and the tokens grouped by slot
    (``segments``, kernels/interface.py) or, in a decode graph's static buffers, ``mask
    [T, num_slots, 1]`` (1 where the token's slot is that one, in the model's dtype); both None
    when every token is in the one slot of the range."""

    token_slots: torch.Tensor
    first_slot: int
    num_slots: int
    mask: torch.Tensor | None = None
    segments: LoraSegments | None = None


def lora_step(
    token_slots: Sequence[int], dtype: torch.dtype, device: torch.device
) -> LoRAStep | None:
    """The step's ``LoRAStep`` from each token's slot (-1: none); None when no token has an
    adapter (the projections then skip the adapters entirely)."""
    used = sorted({s for s in token_slots if s >= 0})
    if not used:
        return None
    first, count = used[0], used[-1] - used[0] + 1
    slots = torch.tensor(token_slots, dtype=torch.int32).to(device)
    if count == 1 and min(token_slots) >= 0:
        return LoRAStep(slots, first, count)
    return LoRAStep(slots, first, count, segments=_segments(token_slots, first, count, device))


def _segments(
    token_slots: Sequence[int], first: int, count: int, device: torch.device
) -> LoraSegments:
    """The tokens of slots ``first .. first + count - 1`` grouped slot by slot, padded to the
    slot with the most."""
    by_slot: list[list[int]] = [[] for _ in range(count)]
    for token, slot in enumerate(token_slots):
        if slot >= 0:
            by_slot[slot - first].append(token)
    per_slot = max(len(tokens) for tokens in by_slot)
    order: list[int] = []
    kept: list[int] = []
    for tokens in by_slot:
        kept += range(len(order), len(order) + len(tokens))
        order += tokens + [0] * (per_slot - len(tokens))
    rows = [order[k] for k in kept]
    padded = len(kept) < len(order)

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(device)

    return LoraSegments(tensor(order), per_slot, tensor(kept) if padded else None, tensor(rows))
