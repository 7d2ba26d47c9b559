"""Mixture-of-experts fp32 weights packed once for oneDNN, expert by expert, on the CPU.

The CPU's grouped pass (engine/platform/cpu/moe.py) multiplies each chosen expert's run of rows
by that expert's weight: a product of a few rows, which ``F.linear`` runs on one core on some
CPUs (engine/platform/cpu/linears.py). ``PackedExperts`` holds each expert's ``[out, in]``
weight in oneDNN's blocked layout instead, packed once at load, and multiplies with
``_linear_pointwise``, as ``Fp32Linear`` does for the projections: ``F.linear``'s products, up
to the order of their sums. The packed copies replace the plain weights (the experts are held
once either way). On the 2-core AMD box (``python -m perf.cpu.bench_moe``,
docs/measurements/model-families.md, "Mixture of experts") a decode step of the random Qwen3-MoE
took 9.3-11.6 ms against 16.4 at 1 stream, 23.5-25.8 against 46.0 at 8. bf16 experts stay on
``F.linear`` (oneDNN already): packed they took 10.3 against 7.3 ms at 1 stream.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paged_serve.engine.model.experts_swap import experts_modules, swap_experts
from paged_serve.engine.model.packed_weights import pack, packable

PACKED_ROWS = {torch.float32: 8}  # the row count each dtype's layout is packed for


class PackedExperts(nn.Module):
    """One projection of every expert, ``[E, out, in]``, each expert packed for oneDNN:
    ``linear(x, e)`` is ``F.linear(x, W[e], bias)`` (engine/platform/cpu/moe.py calls it for the
    experts a step chose)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self._shape = weight.shape
        self._dtype = weight.dtype
        rows = PACKED_ROWS[weight.dtype]
        # Opaque oneDNN tensors, not Parameters: nothing but this module can read them.
        self._packed = [pack(w.detach().contiguous(), rows) for w in weight]

    @property
    def shape(self) -> torch.Size:
        return self._shape

    def dense(self) -> torch.Tensor:
        """The weights, ``[E, out, in]``, as a plain tensor."""
        return torch.stack([p.to_dense() for p in self._packed])

    def linear(
        self, x: torch.Tensor, expert: int, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x [N, in] @ W_e^T + bias``, ``[N, out]``."""
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self._packed[expert], bias, "none", [], ""
        )

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles carry the weights dense (packed tensors are opaque to both)."""
        state = dict(self.__dict__)
        state["_packed"] = self.dense()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        dense = state.pop("_packed")
        super().__setstate__(state)
        self._packed = [pack(w.contiguous(), PACKED_ROWS[self._dtype]) for w in dense]


def _packed_for(weight: torch.Tensor | nn.Module) -> PackedExperts | None:
    """``PackedExperts`` of a plain CPU fp32 experts weight; None for anything else (a
    quantized one, another dtype or device)."""
    if not isinstance(weight, torch.Tensor) or weight.device.type != "cpu":
        return None
    if weight.dtype not in PACKED_ROWS or not packable(weight.dtype):
        return None
    return PackedExperts(weight)


@torch.no_grad()
def pack_experts(model: nn.Module) -> int:
    """Swap every gated experts module's plain CPU fp32 weights for ``PackedExperts``, in place;
    returns how many modules were swapped."""
    return swap_experts(model, _packed_for)


@torch.no_grad()
def restore_plain_experts(model: nn.Module) -> int:
    """Undo ``pack_experts`` in place: each packed projection back to an ``[E, out, in]``
    Parameter (tensor parallelism shards plain ones); returns how many modules."""
    count = 0
    for module in experts_modules(model):
        names = ("gate_up_proj", "down_proj")
        packed = [n for n in names if isinstance(getattr(module, n), PackedExperts)]
        for name in packed:
            dense = getattr(module, name).dense()
            delattr(module, name)
            setattr(module, name, nn.Parameter(dense, requires_grad=False))
        count += bool(packed)
    return count
