"""Hugging Face's own attention over a quantized KV cache's values: the reference the engine's
``--kv-cache-dtype int8``/``fp8`` tokens are compared with.

``fake_quant_attention(code_dtype)`` registers an attention function with transformers that
rounds each new key and value, per token and KV head, to what the cache stores
(``code * scale``, engine/kv/kv_dtype.py: ``scale = max|x| / QMAX``, int8 rounded to nearest,
fp8 by the cast), then runs transformers' SDPA attention on them: the whole model as Hugging
Face computes it, with only the cache's rounding added.
"""

from __future__ import annotations

import copy

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from paged_serve.engine.kv.kv_dtype import QMAX


def round_trip(x: torch.Tensor, code_dtype: torch.dtype) -> torch.Tensor:
    """``x [..., D]`` as a cache of ``code_dtype`` gives it back (fp32 math, x's dtype)."""
    x32 = x.float()
    amax = x32.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / QMAX[code_dtype], torch.ones_like(amax))
    scaled = x32 / scale
    if code_dtype == torch.int8:
        codes = scaled.round().clamp(-127, 127)
    else:
        limit = QMAX[code_dtype]
        codes = scaled.clamp(-limit, limit).to(code_dtype).float()
    return (codes * scale).to(x.dtype)


def fake_quant_attention(code_dtype: torch.dtype, skip: tuple[int, ...] = ()) -> str:
    """The name of a registered attention implementation that stores K and V as
    ``code_dtype`` would (``round_trip``) before transformers' SDPA attention, in every layer
    but those of ``skip`` (layer indices)."""
    name = f"kv_round_trip_{str(code_dtype).removeprefix('torch.')}_skip{'_'.join(map(str, skip))}"

    def forward(module, query, key, value, attention_mask, **kwargs):  # [B, H, T, D]
        if module.layer_idx not in skip:
            key, value = round_trip(key, code_dtype), round_trip(value, code_dtype)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(name, forward)
    return name


def round_latent_entries(
    model: PreTrainedModel, code_dtype: torch.dtype, skip: tuple[int, ...] = ()
) -> PreTrainedModel:
    """A copy of ``model`` whose latent-attention layers (but those of ``skip``) see each
    token's ``[latent, k_rope]`` entry as a cache of ``code_dtype`` gives it back. HF caches
    the entries before ``expand_kv`` and expands them all on every step, so rounding
    ``expand_kv``'s inputs rounds each entry, always from its own unrounded value."""
    reference = copy.deepcopy(model)
    for layer in reference.model.layers:
        attn = layer.self_attn
        if attn.layer_idx in skip:
            continue

        def expand(latent, k_rope, original=attn.expand_kv, rank=attn.kv_lora_rank):
            entry = round_trip(torch.cat((latent, k_rope), dim=-1), code_dtype)
            return original(entry[..., :rank], entry[..., rank:])

        attn.expand_kv = expand
    return reference
