"""One decoder layer: attention and feed-forward blocks between residual adds and RMSNorms.

Each block is ``h = h + s * out_norm(block(in_norm(h)))``, the families placing their norms in
three ways:

* before each block (Llama and most families): ``in_norm`` only;
* after it (OLMo 2): ``out_norm`` only;
* around it (Gemma 2 and 3): both.

``s`` is Granite's ``residual_multiplier`` (none elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from paged_serve.engine.model.body.attention import (
    FamilyAttention,
    Rotary,
    SelfAttention,
    attention_of,
)
from paged_serve.engine.model.body.feed_forward import FamilyBlock, GatedMLP, feed_forward_of
from paged_serve.engine.model.body.norms import RMSNorm


@dataclass(frozen=True, slots=True)
class Layer:
    """What one decoder layer's forward reads, gathered once; a norm None is not there."""

    attention: SelfAttention | FamilyAttention
    feed_forward: GatedMLP | FamilyBlock
    attention_in: RMSNorm | None
    attention_out: RMSNorm | None
    feed_forward_in: RMSNorm | None
    feed_forward_out: RMSNorm | None
    residual_scale: float | None

    @classmethod
    def of(cls, layer: nn.Module, fused_rms_norm: bool) -> Layer:
        def norm(name: str) -> RMSNorm:
            return RMSNorm.of(getattr(layer, name), fused_rms_norm)

        if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma: around each block
            norms = (
                norm("input_layernorm"),
                norm("post_attention_layernorm"),
                norm("pre_feedforward_layernorm"),
                norm("post_feedforward_layernorm"),
            )
        elif not hasattr(layer, "input_layernorm"):  # OLMo 2: after each block
            norms = (
                None,
                norm("post_attention_layernorm"),
                None,
                norm("post_feedforward_layernorm"),
            )
        else:
            norms = (norm("input_layernorm"), None, norm("post_attention_layernorm"), None)
        return cls(
            attention_of(getattr(layer, "self_attn", None) or layer.linear_attn, fused_rms_norm),
            feed_forward_of(layer.mlp),
            *norms,
            residual_scale=getattr(layer, "residual_multiplier", None),
        )

    def __call__(self, h: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        """``h [T, hidden]`` -> the layer's output."""
        x = h if self.attention_in is None else self.attention_in(h)
        h = self._add(h, self.attention(x, rotary), self.attention_out)
        x = h if self.feed_forward_in is None else self.feed_forward_in(h)
        return self._add(h, self.feed_forward(x), self.feed_forward_out)

    def _add(self, h: torch.Tensor, out: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
        if norm is not None:
            out = norm(out)
        return h + (out if self.residual_scale is None else out * self.residual_scale)
