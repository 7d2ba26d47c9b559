"""One decoder layer: attention and feed-forward blocks between residual adds and RMSNorms.

Each block is ``h = h + s * out_norm(block(in_norm(h)))``, the families placing their norms in
three ways:

* before each block (Llama and most families): ``in_norm`` only;
* after it (OLMo 2): ``out_norm`` only;
* around it (Gemma 2 and 3): both;

or, in parallel (Cohere), both blocks read one normed input: ``h = h + attention(x) +
feed_forward(x)`` with ``x = in_norm(h)``.

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
from paged_serve.engine.model.body.norms import Norm, norm_of


@dataclass(frozen=True, slots=True)
class Layer:
    """What one decoder layer's forward reads, gathered once; a norm None is not there."""

    attention: SelfAttention | FamilyAttention
    feed_forward: GatedMLP | FamilyBlock
    attention_in: Norm | None
    attention_out: Norm | None
    feed_forward_in: Norm | None
    feed_forward_out: Norm | None
    residual_scale: float | None
    parallel: bool

    @classmethod
    def of(cls, layer: nn.Module, fused_rms_norm: bool) -> Layer:
        def norm(name: str) -> Norm:
            return norm_of(getattr(layer, name), fused_rms_norm)

        if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma: around each block
            norms = (
                norm("input_layernorm"),
                norm("post_attention_layernorm"),
                norm("pre_feedforward_layernorm"),
                norm("post_feedforward_layernorm"),
            )
        elif not hasattr(layer, "post_attention_layernorm"):  # Cohere: blocks in parallel
            norms = (norm("input_layernorm"), None, None, None)
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
            parallel=not hasattr(layer, "post_attention_layernorm"),
        )

    def __call__(self, h: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        """``h [T, hidden]`` -> the layer's output."""
        x = h if self.attention_in is None else self.attention_in(h)
        if self.parallel:
            return h + self.attention(x, rotary) + self.feed_forward(x)
        h = self._add(h, self.attention(x, rotary), self.attention_out)
        x = h if self.feed_forward_in is None else self.feed_forward_in(h)
        return self._add(h, self.feed_forward(x), self.feed_forward_out)

    def _add(self, h: torch.Tensor, out: torch.Tensor, norm: Norm | None) -> torch.Tensor:
        if norm is not None:
            out = norm(out)
        return h + (out if self.residual_scale is None else out * self.residual_scale)
