"""One decoder layer: attention and feed-forward between residual adds and RMSNorms.

Two arrangements, as the families place their norms:

* pre-norm (Llama and most families)::

      h = h + s * attention(norm_1(h));   h = h + s * feed_forward(norm_2(h))

* post-norm (OLMo 2: no norm on a block's input, one on its output)::

      h = h + norm_1(attention(h));       h = h + norm_2(feed_forward(h))

``s`` is Granite's ``residual_multiplier`` (none elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from paged_serve.engine.model.body.attention import SelfAttention
from paged_serve.engine.model.body.feed_forward import FamilyBlock, GatedMLP, feed_forward_of
from paged_serve.engine.model.body.norms import RMSNorm


@dataclass(frozen=True, slots=True)
class Layer:
    """What one decoder layer's forward reads, gathered once."""

    attention: SelfAttention
    feed_forward: GatedMLP | FamilyBlock
    norm_1: RMSNorm
    norm_2: RMSNorm
    post_norm: bool
    residual_scale: float | None

    @classmethod
    def of(cls, layer: nn.Module, fused_rms_norm: bool) -> Layer:
        post_norm = not hasattr(layer, "input_layernorm")  # OLMo 2
        norm_1 = layer.post_attention_layernorm if post_norm else layer.input_layernorm
        norm_2 = layer.post_feedforward_layernorm if post_norm else layer.post_attention_layernorm
        return cls(
            attention=SelfAttention.of(layer.self_attn, fused_rms_norm),
            feed_forward=feed_forward_of(layer.mlp),
            norm_1=RMSNorm.of(norm_1, fused_rms_norm),
            norm_2=RMSNorm.of(norm_2, fused_rms_norm),
            post_norm=post_norm,
            residual_scale=getattr(layer, "residual_multiplier", None),
        )

    def __call__(
        self, h: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
    ) -> torch.Tensor:
        """``h [T, hidden]`` -> the layer's output; ``cos, signed_sin [T, 1, D]`` (``rope``)."""
        if self.post_norm:
            h = h + self.norm_1(self.attention(h, cos, signed_sin))
            return h + self.norm_2(self.feed_forward(h))
        scale = self.residual_scale
        out = self.attention(self.norm_1(h), cos, signed_sin)
        h = h + (out if scale is None else out * scale)
        out = self.feed_forward(self.norm_2(h))
        return h + (out if scale is None else out * scale)
