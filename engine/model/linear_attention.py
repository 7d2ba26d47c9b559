"""Gated DeltaNet layers (Qwen3-Next, Qwen3.5) over per-sequence state slots.

A hybrid model interleaves softmax-attention layers (paged, through transformers' attention
interface) with gated DeltaNet layers, whose token mixer keeps a causal-convolution window and
a recurrent state per sequence instead of keys and values. HF's module runs one padded batch
with a ``Cache`` object; the engine runs one flat ragged batch, so the module's ``forward`` is
replaced by ``gated_delta_net_flat``, which keeps every weight and sub-module of HF's (the input
projections, ``conv1d``, ``A_log``/``dt_bias``, the gated ``norm``, ``out_proj``) and swaps only
the two stateful operations for the backend's kernels over the step's state slots:

    projections (HF's)  ->  causal conv over the window (kernel)  ->  split q, k, v
    g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)  ->  gated delta rule (kernel)
    ->  norm(o, z) and out_proj (HF's)

Two projection layouts exist: Qwen3-Next's fused ``in_proj_qkvz``/``in_proj_ba``, grouped per
key head (HF's ``fix_query_key_value_ordering`` unpacks it), and Qwen3.5's separate
``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from paged_serve.engine.kv.attention_context import current_attention_context

MIXER_PARTS = ("conv1d", "A_log", "dt_bias", "norm", "out_proj")


def is_gated_delta_net(module: nn.Module) -> bool:
    """A module built as HF's gated DeltaNet token mixers are (either projection layout)."""
    has_parts = all(hasattr(module, p) for p in MIXER_PARTS) and hasattr(module, "layer_idx")
    return has_parts and _projection_layout(module) is not None


def _projection_layout(module: nn.Module) -> str | None:
    if hasattr(module, "in_proj_qkvz") and hasattr(module, "fix_query_key_value_ordering"):
        return "qkvz"
    if all(hasattr(module, p) for p in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")):
        return "qkv"
    return None


def linear_attention_layers(model: nn.Module) -> list[nn.Module]:
    """The model's gated DeltaNet modules."""
    return [m for m in model.modules() if is_gated_delta_net(m)]


def install_linear_attention(model: nn.Module) -> int:
    """Point every gated DeltaNet module's ``forward`` at ``gated_delta_net_flat``; returns how
    many were swapped."""
    layers = linear_attention_layers(model)
    for module in layers:
        module.forward = types.MethodType(gated_delta_net_flat, module)
    return len(layers)


def _project(module: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """HF's input projections of ``hidden [1, T, H]``: ``(mixed_qkv [T, C], z [T, Hv, Dv],
    b [T, Hv], a [T, Hv])``, channels of ``mixed_qkv`` ordered q, k, v as ``conv1d``'s."""
    num_tokens = hidden.shape[1]
    if _projection_layout(module) == "qkvz":
        q, k, v, z, b, a = module.fix_query_key_value_ordering(
            module.in_proj_qkvz(hidden), module.in_proj_ba(hidden)
        )
        mixed = torch.cat([x.reshape(num_tokens, -1) for x in (q, k, v)], dim=-1)
        return mixed, z[0], b[0], a[0]
    mixed = module.in_proj_qkv(hidden)[0]
    z = module.in_proj_z(hidden)[0].unflatten(-1, (-1, module.head_v_dim))
    return mixed, z, module.in_proj_b(hidden)[0], module.in_proj_a(hidden)[0]


def gated_delta_net_flat(
    self: nn.Module, hidden_states: torch.Tensor, *args: object, **kwargs: object
) -> torch.Tensor:
    """The token mixer over the current step's flat batch ``hidden_states [1, T, H]``: its
    sequences continue from (and update) their state slots; ``[1, T, H]``."""
    ctx = current_attention_context()
    conv_state, recurrent = ctx.state_layer(self.layer_idx, "gated DeltaNet")
    mixed, z, b, a = _project(self, hidden_states)
    mixed = ctx.backend.causal_conv(
        mixed.contiguous(),
        self.conv1d.weight.squeeze(1),
        self.conv1d.bias,
        conv_state,
        silu=self.activation in ("silu", "swish"),
        **ctx.slot_args(),
    )
    q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
    beta = b.sigmoid().float()
    g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
    out = ctx.backend.gated_delta_rule(
        q.unflatten(-1, (-1, self.head_k_dim)),
        k.unflatten(-1, (-1, self.head_k_dim)),
        v.unflatten(-1, (-1, self.head_v_dim)),
        g.contiguous(),
        beta.contiguous(),
        recurrent,
        max_seqlen_q=ctx.max_seqlen_q,
        **ctx.slot_args(),
    )
    out = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(out.reshape(1, hidden_states.shape[1], -1))
