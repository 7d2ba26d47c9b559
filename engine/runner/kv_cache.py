"""The KV cache: one allocation for all layers, sized from a memory budget."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


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

    @classmethod
    def for_model(
        cls,
        hf_config: object,
        *,
        budget_bytes: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        tensor_parallel_size: int = 1,
    ) -> KVCache:
        """As many blocks as ``budget_bytes`` holds for a Hugging Face model config's layers and
        KV heads (this rank's share of them under tensor parallelism). Raises ValueError when
        not even one block fits."""
        num_kv_heads = hf_config.num_key_value_heads // tensor_parallel_size
        head_dim = getattr(hf_config, "head_dim", None) or (
            hf_config.hidden_size // hf_config.num_attention_heads
        )
        shape = {
            "num_layers": hf_config.num_hidden_layers,
            "block_size": block_size,
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
            "dtype": dtype,
        }
        per_block = cls.bytes_per_block(**shape)
        num_blocks = budget_bytes // per_block
        if num_blocks < 1:
            raise ValueError(f"KV cache budget holds no block ({per_block} bytes per block)")
        cache = cls(num_blocks=num_blocks, device=device, **shape)
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB (%s)",
            num_blocks,
            block_size,
            num_blocks * block_size,
            cache.num_bytes / 2**20,
            dtype,
        )
        return cache

    @staticmethod
    def bytes_per_block(
        *, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one block takes across all layers, K and V."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize
