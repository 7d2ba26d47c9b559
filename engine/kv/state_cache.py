"""Linear-attention state: a fixed-size state per sequence and layer, beside the paged KV cache.

A gated DeltaNet layer (Qwen3-Next, Qwen3.5: ``layer_types`` entries ``linear_attention``)
keeps, per sequence, the last ``K - 1`` inputs of its causal convolution (``conv [K - 1, C]``, in
the model's dtype, ``C = 2 Hk Dk + Hv Dv`` channels) and its recurrent state
(``recurrent [Hv, Dk, Dv]``, fp32 whatever the model's dtype: it sums the whole sequence). A
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
    """One rank's per-sequence state of a model's gated DeltaNet layers ``layer_ids``."""

    layer_ids: tuple[int, ...]
    num_k_heads: int
    num_v_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_width: int

    @property
    def conv_channels(self) -> int:
        return 2 * self.num_k_heads * self.key_head_dim + self.num_v_heads * self.value_head_dim

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        """One sequence's state over all linear layers (bytes): windows in ``dtype``, fp32
        recurrent states."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        conv = (self.conv_width - 1) * self.conv_channels * itemsize
        recurrent = self.num_v_heads * self.key_head_dim * self.value_head_dim * 4
        return len(self.layer_ids) * (conv + recurrent)


def linear_layer_ids(hf_config: object) -> tuple[int, ...]:
    """Layers whose ``layer_types`` entry is ``linear_attention`` (none for most models)."""
    types = getattr(hf_config, "layer_types", None) or ()
    return tuple(i for i, t in enumerate(types) if t == LINEAR_LAYER_TYPE)


def linear_state_shape(hf_config: object, tensor_parallel_size: int = 1) -> LinearStateShape | None:
    """This rank's state shape of a hybrid model's gated DeltaNet layers (its share of the key
    and value heads), or None for a model without linear-attention layers."""
    layer_ids = linear_layer_ids(hf_config)
    if not layer_ids:
        return None
    return LinearStateShape(
        layer_ids=layer_ids,
        num_k_heads=hf_config.linear_num_key_heads // tensor_parallel_size,
        num_v_heads=hf_config.linear_num_value_heads // tensor_parallel_size,
        key_head_dim=hf_config.linear_key_head_dim,
        value_head_dim=hf_config.linear_value_head_dim,
        conv_width=hf_config.linear_conv_kernel_dim,
    )


class StateCache:
    """Every linear layer's states: ``conv [layers, slots + 1, K - 1, C]`` (model dtype) and
    ``recurrent [layers, slots + 1, Hv, Dk, Dv]`` (fp32); slot ``num_slots`` is scratch."""

    def __init__(
        self, shape: LinearStateShape, *, num_slots: int, dtype: torch.dtype, device: torch.device
    ):
        self.shape = shape
        self.num_slots = num_slots
        self.scratch_slot = num_slots
        layers, rows = len(shape.layer_ids), num_slots + 1
        self.conv = torch.zeros(
            layers, rows, shape.conv_width - 1, shape.conv_channels, dtype=dtype, device=device
        )
        self.recurrent = torch.zeros(
            layers,
            rows,
            shape.num_v_heads,
            shape.key_head_dim,
            shape.value_head_dim,
            dtype=torch.float32,
            device=device,
        )
        self._index = {layer: i for i, layer in enumerate(shape.layer_ids)}

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_idx``'s ``(conv [slots + 1, K - 1, C], recurrent [slots + 1, Hv, Dk,
        Dv])``."""
        i = self._index[layer_idx]
        return self.conv[i], self.recurrent[i]

    def copy_slots(self, pairs: torch.Tensor) -> None:
        """Copy slot ``src`` to ``dst`` in every layer, for each ``(src, dst)`` row of ``pairs
        [N, 2]`` int64 (a forked sequence starts from its parent's state)."""
        src, dst = pairs[:, 0], pairs[:, 1]
        self.conv[:, dst] = self.conv[:, src]
        self.recurrent[:, dst] = self.recurrent[:, src]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.recurrent))
