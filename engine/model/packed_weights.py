"""Weights packed once for oneDNN, in modules that can still be copied and pickled.

``torch.ops.mkldnn._reorder_linear_weight`` lays a weight out in oneDNN's blocked format for a
given row count; ``_linear_pointwise`` multiplies by it. The packed tensor is opaque: torch can
neither deep-copy nor pickle it, and a model is deep-copied (test references, a second engine
on one loaded model) and pickled (tensor-parallel workers are spawned with it). So a module
holding packed weights mixes in ``PackedWeights``: its copies and pickles carry those weights
dense and pack them again on arrival.

oneDNN packs fp32 weights on every x86 CPU it runs on, bf16 ones only where it has a bf16 path
(AVX512-BW/VL/DQ or AVX-NE-CONVERT): on an AVX2-only CPU ``_reorder_linear_weight`` raises for
bf16. ``packable`` tells which; ``pack`` then leaves such a weight plain and ``packed_linear``
multiplies either form, so a bf16 model loads and runs there on ``F.linear``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F


def packable(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN packs weights of ``dtype`` (fp32 or bf16)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight [out, in]`` packed for oneDNN products of about ``rows`` rows (opaque), or the
    plain contiguous weight where this CPU cannot pack its dtype (``packable``)."""
    if not packable(weight.dtype):
        return weight.detach().contiguous()
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


def packed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ W^T + bias`` for a weight ``pack`` returned, packed or plain."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class PackedWeights:
    """Mixin for an ``nn.Module`` whose attributes named in ``PACKED`` hold packed weights,
    packed for ``PACKED_ROWS`` rows."""

    PACKED: ClassVar[tuple[str, ...]]
    PACKED_ROWS: ClassVar[int]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in self.PACKED:
            state[name] = state[name].to_dense()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        for name in self.PACKED:
            state[name] = pack(state[name], self.PACKED_ROWS)
        super().__setstate__(state)  # type: ignore[misc]  # nn.Module's
