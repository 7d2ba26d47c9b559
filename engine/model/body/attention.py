"""One decoder layer's self-attention, as the families the body runs compute it.

The families differ only in a few steps around the same projections, all read from the
attention module when the body is built:

* the projections: ``q_proj``/``k_proj``/``v_proj`` apart (tensor parallelism keeps them apart),
  our fused ``qkv_proj`` (a ``FusedLinear``), or the family's own fused ``qkv_proj`` (Phi-3:
  a plain ``nn.Linear`` whose output is q, k, v in that order);
* QK norms: none, per head over ``head_dim`` (Qwen3; Cohere's LayerNorms, a weight per head
  and lane), or over the whole projection before it is split into heads (OLMo 2, OLMoE: the
  norm's weight spans every head);
* ``clip_qkv`` (OLMoE): q, k and v clamped to ``[-clip, clip]`` after the norms;
* rotary embedding on every layer, or not on the layers a family leaves without (SmolLM3's
  NoPE layers: ``use_rope`` false), over the whole head or its first lanes (a partial rotary
  embedding: Phi-3 or GLM-4.5 with ``partial_rotary_factor`` below 1), rotating halves of the
  head (``rope``) or pairs of lanes (Cohere: ``rope_pairs``);
* soft-capped scores (Gemma 2's ``attn_logit_softcapping``, ``SOFTCAPPED``);
* attention sinks (gpt-oss: a learned logit per query head, ``sinks``).

Token mixers beyond these steps (latent attention, the hybrids' gated attention and gated
DeltaNet) run through their own modules (``FamilyAttention``). The arithmetic is HF's, op for op
on the same values (tests/engine/model/test_model_body.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from paged_serve.engine.model.attention_swap import paged_attention_flat
from paged_serve.engine.model.body.family_module import family_forward
from paged_serve.engine.model.body.norms import Norm, norm_of
from paged_serve.engine.model.fused_projections import FusedLinear

# Attention classes that pass their ``attn_logit_softcapping`` to the attention function (Gemma 3
# keeps the attribute but does not pass it).
SOFTCAPPED = ("Gemma2Attention",)


@dataclass(frozen=True, slots=True)
class Rotary:
    """One step's rotary embedding for a group of layers: ``cos, signed_sin [T, 1, D]`` as
    ``rope`` takes them (None where no layer of the group rotates by them), and what the
    family's rotary module returned (``raw``) with the step's ``position_ids [T]``, as HF's
    model passes them to an attention module (``FamilyAttention``)."""

    cos: torch.Tensor | None
    signed_sin: torch.Tensor | None
    raw: object
    position_ids: torch.Tensor
    interleaved: bool = False  # lanes rotated in pairs (Cohere), not halves: ``rope_pairs``

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H, D]`` rotated by this step's embedding (``rope`` or ``rope_pairs``)."""
        if self.interleaved:
            return rope_pairs(x, self.cos, self.signed_sin)
        return rope(x, self.cos, self.signed_sin)


@dataclass(frozen=True, slots=True)
class QKNorms:
    """The query and key norms; ``per_head``: over ``head_dim`` lanes of each head (Qwen3,
    Cohere), else over the whole ``[T, heads * head_dim]`` projection (OLMo 2, OLMoE)."""

    q: Norm
    k: Norm
    per_head: bool


@dataclass(frozen=True, slots=True)
class SelfAttention:
    """What one layer's attention reads, gathered once; ``__call__`` is its forward up to and
    including ``o_proj``.

    ``qkv``: one module whose output is ``[q | k | v]`` of ``qkv_sizes`` lanes (ours or the
    family's), or None when ``q_proj``/``k_proj``/``v_proj`` run apart.
    """

    index: int
    qkv: nn.Module | None
    qkv_sizes: tuple[int, int, int]
    q_proj: nn.Module | None
    k_proj: nn.Module | None
    v_proj: nn.Module | None
    norms: QKNorms | None
    clip: float | None
    rope: bool
    o_proj: nn.Module
    head_dim: int
    scaling: float
    sliding_window: int | None
    softcap: float | None
    sinks: torch.Tensor | None

    @classmethod
    def of(cls, attn: nn.Module, fused_rms_norm: bool) -> SelfAttention:
        """The attention module ``attn`` of a family the body runs
        (``architecture.FAST_BODY_ARCHITECTURES``)."""
        config, d = attn.config, attn.head_dim
        qkv = getattr(attn, "qkv_proj", None)
        if isinstance(qkv, FusedLinear):
            sizes = tuple(qkv.sizes)
            qkv = qkv.proj
        elif qkv is not None:  # the family's own (Phi-3): its split reads the config's heads
            kv = attn.num_key_value_heads * d
            sizes = (config.num_attention_heads * d, kv, kv)
        else:
            sizes = (0, 0, 0)
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        norms = None
        if q_norm is not None:
            norms = QKNorms(
                norm_of(q_norm, fused_rms_norm),
                norm_of(k_norm, fused_rms_norm),
                per_head=q_norm.weight.shape[-1] == d,  # Cohere's: [heads, head_dim]
            )
        # Qwen2/3 set sliding_window per layer; Mistral, Mixtral and Phi-3 pass their config's
        # to every layer; Llama has neither; Qwen2-MoE's config says 0 for none.
        window = getattr(attn, "sliding_window", getattr(config, "sliding_window", None)) or None
        return cls(
            index=attn.layer_idx,
            qkv=qkv,
            qkv_sizes=sizes,
            q_proj=None if qkv is not None else attn.q_proj,
            k_proj=None if qkv is not None else attn.k_proj,
            v_proj=None if qkv is not None else attn.v_proj,
            norms=norms,
            clip=getattr(config, "clip_qkv", None),
            rope=getattr(attn, "use_rope", True),
            o_proj=attn.o_proj,
            head_dim=d,
            scaling=attn.scaling,
            sliding_window=window,
            softcap=attn.attn_logit_softcapping if type(attn).__name__ in SOFTCAPPED else None,
            sinks=getattr(attn, "sinks", None),
        )

    def __call__(self, x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        """``x [T, hidden]`` (normed) -> ``o_proj``'s output ``[T, hidden]``."""
        tokens, d = x.shape[0], self.head_dim
        if self.qkv is not None and self.norms is None and self.clip is None and self.rope:
            # The common case in one pass over q and k together.
            q_size, k_size, _ = self.qkv_sizes
            y = self.qkv(x)
            qk = rotary.rotate(y[:, : q_size + k_size].view(tokens, -1, d))
            q, k = qk.split((q_size // d, k_size // d), dim=1)
            v = y[:, q_size + k_size :].view(tokens, -1, d)
        else:
            q, k, v = self._qkv(x, rotary)
        out = paged_attention_flat(
            self.index, q, k, v, self.scaling, self.sliding_window, self.softcap, self.sinks
        )
        return self.o_proj(out.reshape(tokens, -1))

    def _qkv(
        self, x: torch.Tensor, rotary: Rotary
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v ``[T, heads, D]`` with the norms, clipping and rotary embedding applied."""
        tokens, d, norms = x.shape[0], self.head_dim, self.norms
        if self.qkv is not None:
            q, k, v = self.qkv(x).split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if norms is not None and not norms.per_head:
            q, k = norms.q(q), norms.k(k)
        if self.clip is not None:
            for t in (q, k, v):
                t.clamp_(min=-self.clip, max=self.clip)
        q, k, v = (t.view(tokens, -1, d) for t in (q, k, v))
        if norms is not None and norms.per_head:
            q, k = norms.q(q), norms.k(k)
        if self.rope:
            q, k = rotary.rotate(q), rotary.rotate(k)
        return q, k, v


@dataclass(frozen=True, slots=True)
class FamilyAttention:
    """A token mixer the family defines beyond the steps above, through its own module's forward
    over ``[1, T, hidden]`` as HF's decoder layer calls it: multi-head latent attention and
    Qwen3-Next's and Qwen3.5's gated attention (``FAMILY_ATTENTIONS``), and their gated DeltaNet
    layers (``linear_attn``), whose modules the engine has already made attend over the paged
    caches and state slots (engine/model/latent_attention.py, linear_attention.py)."""

    module: nn.Module

    def __call__(self, x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        """``x [T, hidden]`` (normed) -> the module's output ``[T, hidden]``."""
        return family_forward(
            self.module,
            x,
            attention_mask=None,
            position_ids=rotary.position_ids[None],
            position_embeddings=rotary.raw,
        )


# Attention classes the body runs through their own forward (FamilyAttention).
FAMILY_ATTENTIONS = (
    "DeepseekV2Attention",
    "DeepseekV3Attention",
    "Glm4MoeLiteAttention",
    "Qwen3NextAttention",
    "Qwen3_5Attention",
    "Qwen3_5MoeAttention",
)


def attention_of(attn: nn.Module, fused_rms_norm: bool) -> SelfAttention | FamilyAttention:
    """The body's token mixer for the module ``attn`` (a layer's ``self_attn`` or
    ``linear_attn``)."""
    if type(attn).__name__ in FAMILY_ATTENTIONS or not hasattr(attn, "o_proj"):
        return FamilyAttention(attn)
    return SelfAttention.of(attn, fused_rms_norm)


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's ``apply_rotary_pos_emb`` on one ``[T, H, D]`` tensor, ``x*cos + rotate_half(x)*sin``
    with ``rotate_half(x) = [-x2, x1]``, computed as ``x*cos + [x2, x1]*[-sin1, sin2]``: a
    product's sign is exact, so this is the same value, one op cheaper (``signed_sin``). A family
    whose rotary embedding stays in fp32 for a bf16 model (OLMo 2) rotates in fp32 and casts the
    result back, as its HF code does. A partial embedding (``cos`` narrower than the head)
    rotates the head's first lanes and passes the rest through, as HF's partial form does."""
    width = cos.shape[-1]
    if width < x.shape[-1]:
        return torch.cat((rope(x[..., :width], cos, signed_sin), x[..., width:]), dim=-1)
    out = (x * cos) + (x.roll(width // 2, dims=-1) * signed_sin)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def rope_pairs(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Cohere's rotary embedding on one ``[T, H, D]`` tensor: lanes rotated in pairs
    ``(x[2i], x[2i+1])``, in fp32 and cast back, as its HF code computes it: ``x*cos +
    rotate(x)*sin`` with ``rotate(x) = [-x[2i+1], x[2i]]`` is ``x*cos + swap(x)*signed_sin``
    (``signed_sin`` negated on the even lanes; a product's sign is exact)."""
    x32 = x.float()
    swapped = x32.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return ((x32 * cos) + (swapped * signed_sin)).to(x.dtype)
