"""The CPU's LoRA products: each token's adapter added to a projection's output with two GEMMs
over the slots the step uses, whatever mix of adapters its tokens bring.

The slots of a step are a range ``first .. first + n - 1`` (``engine/kv/lora_step.py``); their
``A`` matrices are one contiguous ``[n * lanes, in]`` block of the stacked slots, and their
``B^T`` one ``[n * lanes, out]`` block, so::

    s = x @ A_range^T              [T, n * lanes]   every token through every slot of the range
    s = s * mask                   zero but the lanes of each token's own slot
    y += s @ B_range               [T, out]         one GEMM adds each token's own adapter

No Python loop over tokens or adapters: three ops a projection for any mix, and one slot alone
(every token on one adapter, the usual decode of one conversation) skips the mask. The lanes of
other slots cost ``n`` times one adapter's arithmetic, at most ``--max-loras`` adapters of rank
``--max-lora-rank``: small beside the projection itself at the ranks adapters use. The zeros the
mask writes add exactly nothing, so a token's output is its own adapter's.
"""

from __future__ import annotations

import torch


def add_lora_grouped(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    token_slots: torch.Tensor,
    first_slot: int,
    num_slots: int,
    mask: torch.Tensor | None,
) -> None:
    """``AddLora`` (``kernels/interface.py``) on the CPU: reads the slot range and ``mask``,
    not ``token_slots``. a and b contiguous, in the model's dtype."""
    first, n = first_slot, num_slots
    lanes = a.shape[1]
    shrunk = x @ a[first : first + n].reshape(n * lanes, a.shape[2]).t()
    if mask is not None:
        shrunk = (shrunk.view(-1, n, lanes) * mask).view(-1, n * lanes)
    y.addmm_(shrunk, b[first : first + n].reshape(n * lanes, b.shape[2]))
