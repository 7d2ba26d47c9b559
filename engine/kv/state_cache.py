"""Linear-attention state: a fixed-size state per sequence and layer, beside the paged KV cache.

A stateful token mixer keeps, per sequence, the last ``K - 1`` inputs of its causal convolution
(``conv [K - 1, C]``, in the model's dtype) and a recurrent state (fp32 whatever the model's
dtype: it sums the whole sequence). A gated DeltaNet layer (Qwen3-Next, Qwen3.5) convolves ``C =
2 Hk Dk + Hv Dv`` channels and keeps ``[Hv, Dk, Dv]``; a Mamba-2 layer (Bamba, Granite 4.0,
Nemotron-H, Falcon-H1, Mamba-2) convolves ``C = H P + 2 G N`` channels and keeps ``[H, P, N]``
(engine/model/mamba_mixer.py). Both are ``linear_attention`` entries of ``layer_types``. A
sequence holds one *slot* index into every layer's tensors from admission to its end
(``engine/sched/state_slots.py`` hands them out); the last slot is scratch, what the padding
rows of a decode graph read and write.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LINEAR_LAYER_TYPE = "linear_attention"


@dataclass(frozen=True, slots=True)
class LinearStateShape:
    """One rank's per-sequence state of a model's stateful token mixers ``layer_ids``: a
    convolution window ``[conv_width - 1, conv_channels]`` in the model's dtype and a recurrent
    state of shape ``recurrent`` in fp32 (gated DeltaNet: ``[Hv, Dk, Dv]``; Mamba-2: ``[H, P,
    N]``, engine/model/mamba_mixer.py)."""

    layer_ids: tuple[int, ...]
    conv_width: int
    conv_channels: int
    recurrent: tuple[int, int, int]

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        """One sequence's state over all stateful layers (bytes): windows in ``dtype``, fp32
        recurrent states."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        conv = (self.conv_width - 1) * self.conv_channels * itemsize
        heads, rows, cols = self.recurrent
        return len(self.layer_ids) * (conv + heads * rows * cols * 4)


def linear_layer_ids(hf_config: object) -> tuple[int, ...]:
    """Layers whose ``layer_types`` entry is ``linear_attention`` (none for most models)."""
    types = getattr(hf_config, "layer_types", None) or ()
    return tuple(i for i, t in enumerate(types) if t == LINEAR_LAYER_TYPE)


def linear_state_shape(hf_config: object, tensor_parallel_size: int = 1) -> LinearStateShape | None:
    """This rank's state shape of a hybrid model's gated DeltaNet layers (its share of the key
    and value heads), or None for a model without linear-attention layers."""
    layer_ids = linear_layer_ids(hf_config)
    if not layer_ids or getattr(hf_config, "linear_num_key_heads", None) is None:
        return None  # Mamba-2 layers' shape comes from their modules (mamba_state_shape)
    num_k = hf_config.linear_num_key_heads // tensor_parallel_size
    num_v = hf_config.linear_num_value_heads // tensor_parallel_size
    key_dim, value_dim = hf_config.linear_key_head_dim, hf_config.linear_value_head_dim
    return LinearStateShape(
        layer_ids=layer_ids,
        conv_width=hf_config.linear_conv_kernel_dim,
        conv_channels=2 * num_k * key_dim + num_v * value_dim,
        recurrent=(num_v, key_dim, value_dim),
    )


def copy_waves(pairs: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """``(src, dst)`` copies split, in order, into runs that can each run as one gather and
    scatter: a run ends before a pair that reads or writes a row the run already writes."""
    waves: list[list[tuple[int, int]]] = []
    written: set[int] = set()
    for src, dst in pairs:
        if not waves or src in written or dst in written:
            waves.append([])
            written = set()
        waves[-1].append((src, dst))
        written.add(dst)
    return waves


class StateCache:
    """Every stateful layer's states: ``conv [layers, rows, K - 1, C]`` (model dtype) and
    ``recurrent [layers, rows, *shape.recurrent]`` (fp32). Rows ``0 .. num_slots - 1`` are the
    sequences' slots, row ``num_slots`` is scratch, and the ``num_snapshots`` rows after it hold
    states kept at block boundaries for the prefix cache (engine/sched/state_snapshots.py)."""

    def __init__(
        self,
        shape: LinearStateShape,
        *,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device,
        num_snapshots: int = 0,
    ):
        self.shape = shape
        self.num_slots = num_slots
        self.scratch_slot = num_slots
        self.first_snapshot_row = num_slots + 1
        self.num_snapshots = num_snapshots
        layers, rows = len(shape.layer_ids), num_slots + 1 + num_snapshots
        self.conv = torch.zeros(
            layers, rows, shape.conv_width - 1, shape.conv_channels, dtype=dtype, device=device
        )
        self.recurrent = torch.zeros(
            layers, rows, *shape.recurrent, dtype=torch.float32, device=device
        )
        self._index = {layer: i for i, layer in enumerate(shape.layer_ids)}

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_idx``'s ``(conv [rows, K - 1, C], recurrent [rows,
        *shape.recurrent])``."""
        i = self._index[layer_idx]
        return self.conv[i], self.recurrent[i]

    def copy_slots(self, pairs: list[tuple[int, int]]) -> None:
        """Copy row ``src`` to ``dst`` in every layer for each ``(src, dst)`` of ``pairs``, in
        order (a forked sequence starts from its parent's state; snapshots are saved from a
        slot and restored into one, perhaps in the same step): one gather and scatter per run
        of pairs that reads no row an earlier pair of the run writes."""
        for wave in copy_waves(pairs):
            index = torch.tensor(wave, dtype=torch.int64).to(self.conv.device, non_blocking=True)
            src, dst = index[:, 0], index[:, 1]
            self.conv[:, dst] = self.conv[:, src]
            self.recurrent[:, dst] = self.recurrent[:, src]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.recurrent))
