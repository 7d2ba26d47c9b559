"""Weights packed once for oneDNN, in modules that can still be copied and pickled.

``torch.ops.mkldnn._reorder_linear_weight`` lays a weight out in oneDNN's blocked format for a
given row count; ``_linear_pointwise`` multiplies by it. The packed tensor is opaque: torch can
neither deep-copy nor pickle it, and a model is deep-copied (test references, a second engine
on one loaded model) and pickled (tensor-parallel workers are spawned with it). So a module
holding packed weights mixes in ``PackedWeights``: its copies and pickles carry those weights
dense and pack them again on arrival.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch


def pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight [out, in]`` packed for oneDNN products of about ``rows`` rows (opaque)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


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
