"""Swap a Hugging Face model's attention for paged attention, without forking modeling code.

transformers looks attention up by name (``config._attn_implementation``) in its
``AttentionInterface``; we register ``paged_serve`` there and deliberately *no* mask function:
for an attention name without one, transformers' mask builders return None at once, so no
``[T, T]`` mask is built and no packed-sequence detection runs (that check reads a device
tensor on the host, a sync per forward that would also break CUDA-graph capture). The function
receives the projected, rotated ``query [1, Hq, T, D]``, ``key``/``value [1, Hkv, T, D]`` of the
flat ragged batch, writes the new K/V at the step's ``slot_mapping``, and attends over each
sequence's blocks.

Two things HF's modules would get wrong on the flat batch are done here instead, per layer, from
what ``install_paged_attention`` records on each attention module: a ``chunked_attention``
layer (Llama 4: ``config.attention_chunk_size`` C) passes ``attention_chunk`` C to the kernels,
where HF builds a chunked causal mask (a query at ``p`` sees keys ``[p // C * C, p]``); a NoPE
layer with attention temperature tuning (Llama 4) has its module's own tuning switched off,
since that numbers tokens from the HF cache's length, and its queries are scaled here by
``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1`` at each token's true position ``p``
(the step context's ``positions``: device work only, no host sync, CUDA-graph safe).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, PreTrainedModel

from paged_serve.engine.kv.attention_context import current_attention_context
from paged_serve.engine.model.architecture import (
    attention_layers,
    check_servable,
    is_multimodal,
    text_config,
)
from paged_serve.engine.model.latent_attention import (
    install_latent_attention,
    latent_attention_flat,
)
from paged_serve.engine.model.linear_attention import install_linear_attention
from paged_serve.engine.model.mamba_mixer import install_mamba2_mixers
from paged_serve.engine.model.short_conv import install_short_convs

ATTN_NAME = "paged_serve"


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: returns ``([1, T, Hq, D], None)``.

    What the family's attention module passes is honoured: ``scaling`` (Granite's
    ``attention_multiplier``, Gemma's ``query_pre_attn_scalar``), the layer's ``sliding_window``
    (None on full layers), ``softcap`` (Gemma 2: scores soft-capped before the softmax) and
    ``s_aux`` (gpt-oss: one learned sink logit per query head in the softmax denominator).
    A latent-attention module (``engine/model/latent_attention.py``) passes its latent and rope
    key as ``key`` and ``value``: those go to the latent cache."""
    if query.shape[0] != 1:
        raise ValueError(f"paged attention takes one flat batch, got batch size {query.shape[0]}")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if getattr(module, "absorbed", False):
        return latent_attention_flat(module, query, key, value, scale), None
    temperature = getattr(module, "paged_temperature", None)
    if temperature is not None:
        query = tuned_query(query, current_attention_context().positions, *temperature)
    out = paged_attention_flat(
        module.layer_idx,
        query[0].transpose(0, 1),  # [T, Hq, D]
        key[0].transpose(0, 1),  # [T, Hkv, D]
        value[0].transpose(0, 1),
        scale,
        sliding_window,
        softcap=softcap or None,
        sinks=s_aux,
        causal=getattr(module, "is_causal", True) is not False,
        attention_chunk=getattr(module, "paged_attention_chunk", None),
    )
    return out.unsqueeze(0), None


def tuned_query(
    query: torch.Tensor, positions: torch.Tensor | None, floor_scale: float, attn_scale: float
) -> torch.Tensor:
    """Llama 4's attention temperature tuning of a NoPE layer: ``query [1, Hq, T, D]`` times
    ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1`` at each token's position ``p``
    (``positions [T]``), computed in fp32 and returned in query's dtype, as HF does."""
    if positions is None:
        raise RuntimeError("attention temperature tuning needs the step's token positions")
    scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
    return (query * scales.view(1, 1, -1, 1)).to(query.dtype)


def paged_attention_flat(
    layer_idx: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    causal: bool = True,
    attention_chunk: int | None = None,
) -> torch.Tensor:
    """Layer ``layer_idx`` of the current step: write ``k, v [T, Hkv, D]`` at the step's slots,
    then attend ``q [T, Hq, D]`` over each sequence's blocks; ``[T, Hq, D]``. ``softcap``,
    ``sinks [Hq]``, ``causal`` (False: a bidirectional encoder's layer, each query seeing
    its whole sequence) and ``attention_chunk`` (tokens: a query at ``p`` sees no key before
    ``p // C * C``) as in ``kernels/interface.py``."""
    ctx = current_attention_context()
    k_cache, v_cache = ctx.kv_cache.layer(layer_idx)
    scales = ctx.kv_cache.layer_scales(layer_idx)  # a quantized cache's (engine/kv/kv_dtype.py)
    quantized = {} if scales is None else {"k_scale": scales[0], "v_scale": scales[1]}
    ctx.backend.write_kv(k, v, k_cache, v_cache, slot_mapping=ctx.slot_mapping, **quantized)
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
        softcap=softcap,
        sinks=sinks,
        causal=causal,
        attention_chunk=attention_chunk,
        **quantized,
    )


AttentionInterface.register(ATTN_NAME, paged_attention_forward)


def install_paged_attention(model: PreTrainedModel, pooling: bool = False) -> None:
    """Point every attention layer of ``model`` at the paged attention function (ValueError,
    naming what is missing, for a model the engine cannot serve: engine/model/architecture.py;
    ``pooling``: a pooling model, which may be a bidirectional encoder)."""
    check_servable(model, pooling)
    install_latent_attention(model)  # MLA: absorbed weights over the latent cache
    install_linear_attention(model)  # gated DeltaNet mixers over state slots
    install_mamba2_mixers(model)  # Mamba-2 mixers over state slots
    install_short_convs(model)  # LFM2's gated short convolutions over state slots
    install_layer_bounds(model)  # chunked layers, NoPE layers' temperature tuning (Llama 4)
    if is_multimodal(model):  # the vision encoder keeps its own attention: no paged KV
        others = {key: "sdpa" for key in model.config.sub_configs if key != "text_config"}
        model.set_attn_implementation({"text_config": ATTN_NAME, **others})
    else:
        model.set_attn_implementation(ATTN_NAME)


CHUNKED_LAYER_TYPE = "chunked_attention"


def install_layer_bounds(model: PreTrainedModel) -> None:
    """Record on each attention module what ``paged_attention_forward`` applies for it, in
    place: ``paged_attention_chunk`` (``config.attention_chunk_size`` on a ``chunked_attention``
    layer, else None) and, on a NoPE layer that tunes its attention temperature (Llama 4's
    ``attn_temperature_tuning`` where ``use_rope`` is off), ``paged_temperature`` =
    ``(floor_scale, attn_scale)``, switching the module's own tuning off."""
    config = text_config(model)
    layer_types = getattr(config, "layer_types", None) or []
    chunk = getattr(config, "attention_chunk_size", None)
    for module in attention_layers(model):
        index = module.layer_idx
        chunked = index < len(layer_types) and layer_types[index] == CHUNKED_LAYER_TYPE
        if chunked and not chunk:
            raise ValueError(f"layer {index} is chunked_attention without attention_chunk_size")
        module.paged_attention_chunk = int(chunk) if chunked else None
        if getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", 1):
            module.paged_temperature = (float(module.floor_scale), float(module.attn_scale))
            module.attn_temperature_tuning = False
