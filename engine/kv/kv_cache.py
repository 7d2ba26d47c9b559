"""The KV cache: one allocation for all layers, sized from a memory budget.

Per-head attention stores a key and a value per KV head and token, in the model's dtype or
quantized (``--kv-cache-dtype int8`` or ``fp8``: codes of one byte, with an fp32 scale per token
and KV head beside them, ``scales``; a value is ``code * scale``, engine/kv/kv_dtype.py);
multi-head latent attention (DeepSeek's MLA) stores one entry per token, its normalised latent
and shared rotated key part (``kv_lora_rank + qk_rope_head_dim`` lanes, shared by every head and
every tensor-parallel rank), likewise in the model's dtype or as codes with one fp32 scale per
token (the entry quantized as one head).
``CacheLayout`` says which a model needs; blocks, block tables, the prefix cache and
copy-on-write are the same for both. Only softmax-attention layers have a KV cache: a hybrid
model's linear-attention layers keep per-sequence state instead (``state_cache.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from paged_serve.engine.kv.kv_dtype import is_quantized
from paged_serve.engine.kv.state_cache import linear_layer_ids

logger = logging.getLogger(__name__)

FEED_FORWARD_LAYER_TYPES = ("mlp", "moe")  # Nemotron-H: a layer without a token mixer
# layer types without keys and values: those, and LFM2's short convolutions (state slots,
# state_cache.py)
NO_KV_LAYER_TYPES = (*FEED_FORWARD_LAYER_TYPES, "conv")


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """What one token stores in one layer: ``sides`` tensors (2: K and V; 1: a latent cache's
    entry) of ``num_kv_heads x head_dim`` elements each."""

    sides: int
    num_kv_heads: int
    head_dim: int
    kv_lora_rank: int | None = None  # latent lanes of a latent entry (the rest are rope)

    @property
    def latent(self) -> bool:
        return self.kv_lora_rank is not None

    def elements_per_token(self) -> int:
        """Elements one token takes in one layer."""
        return self.sides * self.num_kv_heads * self.head_dim


def cache_layout(hf_config: object, tensor_parallel_size: int = 1) -> CacheLayout:
    """The layout a Hugging Face config needs on one tensor-parallel rank: this rank's KV heads,
    or for latent attention the whole (replicated) latent entry."""
    kv_lora_rank = getattr(hf_config, "kv_lora_rank", None)
    if kv_lora_rank:
        width = kv_lora_rank + hf_config.qk_rope_head_dim
        return CacheLayout(sides=1, num_kv_heads=1, head_dim=width, kv_lora_rank=kv_lora_rank)
    head_dim = getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    heads = kv_heads // tensor_parallel_size
    return CacheLayout(sides=2, num_kv_heads=heads, head_dim=head_dim)


def attention_layer_ids(hf_config: object) -> tuple[int, ...]:
    """The layers that cache keys and values: every layer but the linear-attention ones and
    those of ``NO_KV_LAYER_TYPES``."""
    linear = set(linear_layer_ids(hf_config))
    types = getattr(hf_config, "layer_types", None) or ()
    other = {i for i, t in enumerate(types) if t in NO_KV_LAYER_TYPES}
    return tuple(i for i in range(hf_config.num_hidden_layers) if i not in linear | other)


def per_head_elements_per_token(hf_config: object) -> int:
    """Elements one token would take in one layer were a latent-attention model's keys and
    values cached per head: ``H * (qk_nope + qk_rope + v_head_dim)``, what the latent entry
    (``kv_lora_rank + qk_rope``) is measured against."""
    key = hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim
    return hf_config.num_attention_heads * (key + hf_config.v_head_dim)


class KVCache:
    """Every attention layer's cache: ``[num_layers, sides, num_blocks, block_size,
    num_kv_heads, head_dim]``, in ``dtype`` or, with a quantized ``cache_dtype``, its codes
    beside ``scales [num_layers, sides, num_blocks, block_size, num_kv_heads]`` fp32 (a latent
    cache: one side and one "head", so one scale per token, ``latent_scales(i)``).

    One tensor, so the block-copy kernel copies a block for every layer in one launch;
    ``layer(i)`` returns decoder layer ``i``'s ``[num_blocks, block_size, num_kv_heads,
    head_dim]`` K and V views, ``latent(i)`` a latent cache's ``[num_blocks, block_size,
    kv_lora_rank + rope]`` entries. ``layer_ids``: the decoder layers cached, in order (default
    ``0 .. num_layers - 1``; a hybrid model's attention layers only).
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        layout: CacheLayout,
        dtype: torch.dtype,
        device: torch.device,
        layer_ids: tuple[int, ...] | None = None,
        cache_dtype: torch.dtype | None = None,
        skip_layers: frozenset[int] = frozenset(),
    ):
        layer_ids = tuple(range(num_layers)) if layer_ids is None else layer_ids
        quantized = cache_dtype is not None and is_quantized(cache_dtype)
        if len(layer_ids) != num_layers:
            raise ValueError(f"{len(layer_ids)} layer ids for {num_layers} cached layers")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.layout = layout
        # A quantized cache's layers hold codes; those of ``skip_layers`` (decoder layer ids,
        # --kv-cache-dtype-skip-layers) values in the model's dtype, in a tensor of their own.
        coded = [i for i in layer_ids if quantized and i not in skip_layers]
        plain = [i for i in layer_ids if i not in coded]
        shape = (layout.sides, num_blocks, block_size, layout.num_kv_heads)

        def cache(count: int, element: torch.dtype) -> torch.Tensor:
            return torch.zeros(count, *shape, layout.head_dim, dtype=element, device=device)

        self.tensor = cache(len(coded), cache_dtype) if coded else cache(len(plain), dtype)
        self.plain = cache(len(plain), dtype) if coded and plain else None
        # per token and KV head of a coded layer (per token of a latent cache, whose entry is
        # its one "head"): the scale of its codes (None: no codes)
        self.scales = torch.ones(len(coded), *shape, device=device) if coded else None
        values = self.tensor if not coded else self.plain
        # The per-layer views, made once (a step asks for every layer's)
        if layout.latent:
            self._latents = {layer: self.tensor[i, 0, :, :, 0] for i, layer in enumerate(coded)}
            self._latent_scales = {
                layer: self.scales[i, 0, :, :, 0] for i, layer in enumerate(coded)
            }
            for i, layer in enumerate(plain):
                self._latents[layer] = values[i, 0, :, :, 0]
            return
        self._scales = {
            layer: (self.scales[i, 0], self.scales[i, 1]) for i, layer in enumerate(coded)
        }
        self._layers = {
            layer: (self.tensor[i, 0], self.tensor[i, 1]) for i, layer in enumerate(coded)
        }
        for i, layer in enumerate(plain):
            self._layers[layer] = (values[i, 0], values[i, 1])

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index``'s K and V caches (per-head layout)."""
        if self.layout.latent:
            raise RuntimeError("a latent cache has no per-head K and V: use latent(i)")
        return self._layers[index]

    def layer_scales(self, index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer ``index``'s K and V scales ``[num_blocks, block_size, num_kv_heads]``, or None
        when the cache holds values, not codes."""
        if self.layout.latent:
            raise RuntimeError("a latent cache has no K and V scales: use latent_scales(i)")
        return self._scales.get(index)

    def latent(self, index: int) -> torch.Tensor:
        """Layer ``index``'s latent entries ``[num_blocks, block_size, kv_lora_rank + rope]``:
        values in the model's dtype, or a quantized layer's codes."""
        if not self.layout.latent:
            raise RuntimeError("a per-head KV cache has no latent entries: use layer(i)")
        return self._latents[index]

    def latent_scales(self, index: int) -> torch.Tensor | None:
        """Layer ``index``'s latent scales ``[num_blocks, block_size]`` fp32, one per token (an
        entry is ``code * scale``), or None when the layer holds values, not codes."""
        if not self.layout.latent:
            raise RuntimeError("a per-head KV cache has no latent scales: use layer_scales(i)")
        return self._latent_scales.get(index)

    def block_tensors(self) -> list[torch.Tensor]:
        """Every tensor whose blocks a block copy copies, each ``[layers, sides, num_blocks,
        ...]``: the codes or values, a quantized cache's scales (a lane of their own) and its
        unquantized layers' values."""
        tensors = [self.tensor]
        if self.scales is not None:
            tensors.append(self.scales[..., None])
        if self.plain is not None:
            tensors.append(self.plain)
        return tensors

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.block_tensors())

    @property
    def num_tokens(self) -> int:
        """Tokens the cache holds (every sequence's together)."""
        return self.num_blocks * self.block_size

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
        cache_dtype: torch.dtype | None = None,
        skip_layers: frozenset[int] = frozenset(),
        stateless_blocks: int = 0,
    ) -> KVCache:
        """As many blocks as ``budget_bytes`` holds for a Hugging Face model config's layers and
        layout (this rank's share of the KV heads under tensor parallelism). Raises ValueError
        when not even one block fits. A model without attention layers (Mamba-2) caches
        nothing per token: its blocks only count tokens, ``stateless_blocks`` of them."""
        layer_ids = attention_layer_ids(hf_config)
        num_layers = len(layer_ids)
        if not num_layers:
            layout = CacheLayout(sides=2, num_kv_heads=0, head_dim=0)
            return cls(
                num_layers=0,
                num_blocks=stateless_blocks,
                block_size=block_size,
                layout=layout,
                dtype=dtype,
                device=device,
                layer_ids=(),
            )
        layout = cache_layout(hf_config, tensor_parallel_size)
        skipped = len(set(layer_ids) & skip_layers) if cache_dtype is not None else 0
        per_block = cls.bytes_per_block(
            num_layers=num_layers - skipped,
            block_size=block_size,
            layout=layout,
            dtype=cache_dtype or dtype,
        ) + cls.bytes_per_block(
            num_layers=skipped, block_size=block_size, layout=layout, dtype=dtype
        )
        num_blocks = budget_bytes // per_block
        if num_blocks < 1:
            raise ValueError(f"KV cache budget holds no block ({per_block} bytes per block)")
        cache = cls(
            num_layers=num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            layout=layout,
            dtype=dtype,
            device=device,
            layer_ids=layer_ids,
            cache_dtype=cache_dtype,
            skip_layers=skip_layers,
        )
        logger.info(
            "KV cache%s: %d blocks x %d tokens = %d tokens, %.1f MiB (%s)",
            " (latent)" if layout.latent else "",
            num_blocks,
            block_size,
            cache.num_tokens,
            cache.num_bytes / 2**20,
            cache_dtype if cache.scales is not None else dtype,
        )
        return cache

    @staticmethod
    def bytes_per_block(
        *, num_layers: int, block_size: int, layout: CacheLayout, dtype: torch.dtype
    ) -> int:
        """Bytes one block takes across all layers (both sides of a per-head layout); a
        quantized ``dtype``'s codes take a byte each, and each token's KV heads an fp32 scale."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        per_token = layout.elements_per_token() * itemsize
        if is_quantized(dtype):
            per_token += layout.sides * layout.num_kv_heads * 4
        return num_layers * block_size * per_token
