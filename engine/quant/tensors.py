"""Where a format's reader gets a checkpoint's tensors: by name, whole, on the host."""

from __future__ import annotations

from typing import Protocol

import torch


class StoredTensors(Protocol):
    """A checkpoint's tensors by name (``name in tensors``; ``tensors.get(name)``: the whole
    tensor as stored, on the CPU)."""

    def __contains__(self, name: object) -> bool: ...

    def get(self, name: str) -> torch.Tensor: ...


def refuse(option: str, why: str) -> ValueError:
    """The start error for a format option the engine does not serve, naming it."""
    return ValueError(f"quantization_config: {option} is not served ({why})")


def expect_shape(tensor: torch.Tensor, shape: tuple[int, ...], name: str) -> torch.Tensor:
    """``tensor`` when it has ``shape``, else a ValueError naming ``name`` and both shapes."""
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")
    return tensor
