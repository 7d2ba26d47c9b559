"""How much memory a prepared model's weights hold, and how they are stored: logged at start,
on the dashboard (``GET /v1/engine/state``'s ``weights``) and, for the storage, on ``/v1/models``.

Counted once the platform has prepared the model (``prepare_model``), because preparing changes
the bytes: the CPU packs projections for oneDNN (opaque tensors held outside the parameters),
may keep a second copy for another row count, and dequantizes some stored-quantized layers.
Every parameter, buffer and packed weight (``PackedWeights.PACKED``) is counted once, however
many modules share it (tied embeddings). Under tensor parallelism this is one rank's shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from paged_serve.engine.model.packed_weights import PackedWeights

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class WeightMemory:
    """A model's weights on its device: ``bytes`` in all, ``dtype`` the dtype it computes in,
    ``quantization`` how the checkpoint stores them (None: unquantized)."""

    bytes: int
    dtype: str
    quantization: str | None

    def describe(self) -> str:
        """One line for the start-up log."""
        stored = f", stored {self.quantization}" if self.quantization else ""
        return f"weights: {self.bytes / MIB:.1f} MiB in memory ({self.dtype}{stored})"


def _tensors(model: nn.Module):
    yield from model.parameters()
    yield from model.buffers()
    for module in model.modules():
        if isinstance(module, PackedWeights):
            for name in module.PACKED:
                value = getattr(module, name, None)
                if isinstance(value, torch.Tensor):
                    yield value


def _key(t: torch.Tensor) -> object:
    """The identity of ``t``'s memory: its storage where it has one (views and tied weights
    share it), the tensor itself for opaque oneDNN tensors."""
    if t.is_mkldnn or t.is_meta:
        return id(t)
    return t.untyped_storage().data_ptr()


def _bytes(t: torch.Tensor) -> int:
    if t.is_mkldnn or t.is_meta:
        return t.numel() * t.element_size()
    return t.untyped_storage().nbytes()


def weight_memory(
    model: nn.Module, dtype: torch.dtype, quantization: str | None = None
) -> WeightMemory:
    """The ``WeightMemory`` of ``model`` (module docstring)."""
    seen: set[object] = set()
    total = 0
    for t in _tensors(model):
        key = _key(t)
        if key in seen:
            continue
        seen.add(key)
        total += _bytes(t)
    return WeightMemory(total, str(dtype).removeprefix("torch."), quantization)
