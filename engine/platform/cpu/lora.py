"""The CPU's LoRA products: each token's adapter added to a projection's output, whatever mix
of adapters a step's tokens bring, with no Python loop over tokens or adapters.

* Every token in one slot (one conversation decoding, or a batch on one adapter): two GEMMs,
  ``y += (x @ A_s^T) @ B_s``.
* Several slots (``segments``, engine/kv/lora_step.py): the tokens gathered slot by slot into
  ``[n, per_slot, in]`` (a slot with fewer tokens padded), two batched GEMMs against the
  contiguous slots ``first .. first + n - 1`` (``A [n, lanes, in]``, ``B^T [n, lanes, out]``:
  views, no copy), the real rows added back with ``index_add_``. Each token multiplies its own
  adapter only, and each adapter's matrices are read once a projection.
* A decode graph's static buffers (``mask``): every token through every slot of the range, the
  other slots' lanes zeroed by the mask, one GEMM back; the zeros add exactly nothing.
"""

from __future__ import annotations

import torch

from paged_serve.kernels.interface import LoraSegments


def add_lora_grouped(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    token_slots: torch.Tensor,
    first_slot: int,
    num_slots: int,
    mask: torch.Tensor | None,
    segments: LoraSegments | None,
) -> None:
    """``AddLora`` (``kernels/interface.py``) on the CPU: reads the slot range and ``segments``
    (or a decode graph's ``mask``), not ``token_slots``. a and b contiguous, in the model's
    dtype."""
    first, n = first_slot, num_slots
    lanes, inputs, outputs = a.shape[1], a.shape[2], b.shape[2]
    if segments is not None:  # each slot's tokens through that slot alone
        m = segments.per_slot
        grouped = x.index_select(0, segments.order).view(n, m, inputs)
        shrunk = torch.bmm(grouped, a[first : first + n].transpose(1, 2))
        out = torch.bmm(shrunk, b[first : first + n]).view(n * m, outputs)
        if segments.kept is not None:
            out = out.index_select(0, segments.kept)
        y.index_add_(0, segments.rows, out)
        return
    shrunk = x @ a[first : first + n].reshape(n * lanes, inputs).t()
    if mask is not None:
        shrunk = (shrunk.view(-1, n, lanes) * mask).view(-1, n * lanes)
    y.addmm_(shrunk, b[first : first + n].reshape(n * lanes, outputs))
