"""Swap a Hugging Face model's attention for paged attention, without forking modeling code.

transformers looks attention up by name (``config._attn_implementation``) in its
``AttentionInterface``; we register ``paged_serve`` there and deliberately *no* mask function:
for an attention name without one, transformers' mask builders return None at once, so no
``[T, T]`` mask is built and no packed-sequence detection runs (that check reads a device
tensor on the host, a sync per forward that would also break CUDA-graph capture). The function
receives the projected, rotated ``query [1, Hq, T, D]``, ``key``/``value [1, Hkv, T, D]`` of the
flat ragged batch, writes the new K/V at the step's ``slot_mapping``, and attends over each
sequence's blocks.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, PreTrainedModel

from engine.runner.attention_context import current_attention_context

ATTN_NAME = "paged_serve"

# Architectures whose attention modules call the attention interface with RoPE already applied
# and expose ``layer_idx``; others are refused at load rather than silently computed wrong.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: returns ``([1, T, Hq, D], None)``."""
    if query.shape[0] != 1:
        raise ValueError(f"paged attention takes one flat batch, got batch size {query.shape[0]}")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = paged_attention_flat(
        module.layer_idx,
        query[0].transpose(0, 1),  # [T, Hq, D]
        key[0].transpose(0, 1),  # [T, Hkv, D]
        value[0].transpose(0, 1),
        scale,
        sliding_window,
    )
    return out.unsqueeze(0), None


def paged_attention_flat(
    layer_idx: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Layer ``layer_idx`` of the current step: write ``k, v [T, Hkv, D]`` at the step's slots,
    then attend ``q [T, Hq, D]`` over each sequence's blocks; ``[T, Hq, D]``."""
    ctx = current_attention_context()
    k_cache, v_cache = ctx.kv_cache.layer(layer_idx)
    ctx.backend.write_kv(k, v, k_cache, v_cache, slot_mapping=ctx.slot_mapping)
    return ctx.backend.paged_attention(
        q,
        k_cache,
        v_cache,
        block_tables=ctx.block_tables,
        seq_lens=ctx.seq_lens,
        cu_seqlens_q=ctx.cu_seqlens_q,
        scale=scale,
        max_seqlen_q=ctx.max_seqlen_q,
        max_seqlen_k=ctx.max_seqlen_k,
        sliding_window=sliding_window,
    )


AttentionInterface.register(ATTN_NAME, paged_attention_forward)


def check_supported(model: PreTrainedModel) -> None:
    """Raise ValueError unless ``model`` is one of the architectures the swap is tested on."""
    name = type(model).__name__
    if name not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {name}: paged-serve runs "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )


def install_paged_attention(model: PreTrainedModel) -> None:
    """Point every attention layer of ``model`` at the paged attention function."""
    check_supported(model)
    model.set_attn_implementation(ATTN_NAME)
