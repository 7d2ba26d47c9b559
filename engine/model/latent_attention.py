"""Multi-head latent attention (MLA: DeepSeek-V2/V3 and the models built like them) on the paged
latent cache, through the model's own attention modules.

Hugging Face's MLA modules project the query, the compressed latent and the shared rope key,
normalise the latent, rotate the rope parts, and then call ``self.expand_kv(latent, k_rope)``,
which up-projects per-head keys and values with ``kv_b_proj`` for the attention function. The
engine caches what comes *before* that expansion, one ``kv_lora_rank + qk_rope_head_dim`` entry
per token, and never expands it. Two changes per module, no forked modeling code:

* **Absorbed weights.** ``kv_b_proj``'s weight ``[H * (nope + v), R]`` is split into ``W_UK
  [H, nope, R]`` and ``W_UV^T [H, R, v]`` buffers and the projection is dropped. A query's
  ``q_nope @ W_UK`` scores the latent directly (``q_nope . (W_UK c) = (q_nope W_UK) . c``) and
  the latent output times ``W_UV^T`` is the per-head value output (DeepSeek-V2's "weight
  absorption"): the same arithmetic as HF's expansion, summed in another order.
* **No expansion.** The instance's ``expand_kv`` returns its inputs, so the attention function
  (``engine/model/attention_swap.py``) receives the latent ``[1, 1, T, R]`` and the rotated rope
  key ``[1, 1, T, rope]`` as its "key" and "value", and hands them to
  :func:`latent_attention_flat`.

Prefill chunks and decode tokens both attend with absorbed queries, over the cache, in one
kernel (``kernels/triton/mla_attention.py``; the reference ``mla_attention_ref`` on the CPU).
With ``--kv-cache-dtype int8``/``fp8`` the cache holds each entry as one-byte codes with one
fp32 scale per token: the write quantizes, the attention dequantizes as it reads.
Under tensor parallelism the heads are sharded (``q_proj``/``q_b_proj`` and ``kv_b_proj`` by
output rows, ``o_proj`` by input columns); every rank caches the whole, replicated latent.
"""

from __future__ import annotations

import torch
from torch import nn

from paged_serve.engine.kv.attention_context import current_attention_context

LATENT_ATTRIBUTES = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def is_latent_attention(module: nn.Module) -> bool:
    """Whether ``module`` is an MLA module built as HF's DeepSeek-V3 one (or already swapped)."""
    if getattr(module, "absorbed", False):
        return True
    return (
        all(hasattr(module, name) for name in LATENT_ATTRIBUTES)
        and isinstance(getattr(module, "kv_b_proj", None), nn.Linear)
        and callable(getattr(module, "expand_kv", None))
    )


def unservable_latent_reason(module: nn.Module) -> str | None:
    """Why a latent-attention module cannot run on the latent cache; None when it can."""
    if hasattr(module, "indexer"):
        return (
            "uses DeepSeek sparse attention (an indexer picks each query's top-k keys), which "
            "paged-serve does not support yet"
        )
    if not is_latent_attention(module):
        return (
            "uses multi-head latent attention (MLA) in a module paged-serve does not know: it "
            "needs kv_b_proj, expand_kv and the kv_lora_rank / qk_*_head_dim / v_head_dim sizes"
        )
    return None


def absorb_latent_attention(module: nn.Module) -> None:
    """Give ``module`` absorbed ``w_uk [H, nope, R]`` and ``w_uv_t [H, R, v]`` buffers, drop its
    ``kv_b_proj``, and make its ``expand_kv`` the identity. Idempotent."""
    if getattr(module, "absorbed", False):
        return
    nope, v_dim, rank = module.qk_nope_head_dim, module.v_head_dim, module.kv_lora_rank
    weight = module.kv_b_proj.weight.detach()  # [H * (nope + v), R], this rank's heads
    if module.kv_b_proj.bias is not None:
        raise ValueError("kv_b_proj has a bias, which absorbed latent attention cannot carry")
    heads = weight.shape[0] // (nope + v_dim)
    per_head = weight.view(heads, nope + v_dim, rank)
    module.register_buffer("w_uk", per_head[:, :nope].contiguous(), persistent=False)
    module.register_buffer(
        "w_uv_t", per_head[:, nope:].transpose(1, 2).contiguous(), persistent=False
    )
    module.kv_b_proj = None
    module.expand_kv = _latent_as_is
    module.absorbed = True


def _latent_as_is(latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The swapped ``expand_kv``: the latent and rope key go to the attention function as is."""
    return latent, k_rope


def install_latent_attention(model: nn.Module) -> int:
    """Absorb every latent-attention module of ``model``; the number swapped."""
    modules = [m for m in model.modules() if is_latent_attention(m)]
    for module in modules:
        absorb_latent_attention(module)
    return len(modules)


def latent_attention_flat(
    module: nn.Module,
    query: torch.Tensor,
    latent: torch.Tensor,
    k_rope: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Layer ``module.layer_idx`` of the current step: write each token's ``[latent, k_rope]``
    entry at the step's slots, attend the absorbed queries over each sequence's entries and
    apply ``W_UV``. ``query [1, H, T, nope + rope]``, ``latent [1, 1, T, R]``, ``k_rope [1, 1,
    T, rope]``; returns ``[1, T, H, v_head_dim]``."""
    ctx = current_attention_context()
    cache = ctx.kv_cache.latent(module.layer_idx)
    # a quantized cache's per-token scales [num_blocks, block_size] (engine/kv/kv_dtype.py)
    scales = ctx.kv_cache.latent_scales(module.layer_idx)
    quantized = {} if scales is None else {"latent_scale": scales}
    entry = torch.cat((latent[0, 0], k_rope[0, 0]), dim=-1)  # [T, R + rope]
    ctx.backend.write_latent(entry, cache, slot_mapping=ctx.slot_mapping, **quantized)
    nope = module.qk_nope_head_dim
    q = query[0]  # [H, T, nope + rope]
    q_latent = torch.bmm(q[..., :nope], module.w_uk)  # [H, T, R]
    q_abs = torch.cat((q_latent, q[..., nope:]), dim=-1).transpose(0, 1).contiguous()
    out_latent = ctx.backend.mla_attention(
        q_abs,
        cache,
        block_tables=ctx.block_tables,
        seq_lens=ctx.seq_lens,
        cu_seqlens_q=ctx.cu_seqlens_q,
        scale=scale,
        kv_lora_rank=module.kv_lora_rank,
        max_seqlen_q=ctx.max_seqlen_q,
        max_seqlen_k=ctx.max_seqlen_k,
        **quantized,
    )  # [T, H, R]
    out = torch.bmm(out_latent.transpose(0, 1), module.w_uv_t)  # [H, T, v]
    return out.transpose(0, 1).unsqueeze(0)
