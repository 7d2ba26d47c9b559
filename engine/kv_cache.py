"""The KV cache: one allocation for all layers, sized from a memory budget."""

from __future__ import annotations

import torch


class KVCache:
    """K and V for every layer: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.

    One tensor, so the block-copy kernel copies a block for every layer in one launch;
    ``layer(i)`` returns the ``[num_blocks, block_size, num_kv_heads, head_dim]`` K and V views.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.tensor = torch.zeros(
            num_layers,
            2,
            num_blocks,
            block_size,
            num_kv_heads,
            head_dim,
            dtype=dtype,
            device=device,
        )
        self._layers = [(self.tensor[i, 0], self.tensor[i, 1]) for i in range(num_layers)]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layers[index]

    @property
    def num_bytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    @staticmethod
    def bytes_per_block(
        *, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one block takes across all layers, K and V."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize
