"""Gated short convolutions (Liquid's LFM2, dense and MoE) over per-sequence state slots.

An LFM2 ``conv`` layer mixes tokens with no attention and no recurrent state: ``in_proj``
splits each token into ``B``, ``C`` and ``x`` (``hidden`` lanes each), the depthwise causal
convolution ``conv`` (``conv_L_cache`` taps, no activation) runs over ``B * x``, and ``C`` gates
its output before ``out_proj``. Its state per sequence is the convolution's window alone: the
last ``conv_L_cache - 1`` rows of ``B * x``. ``short_conv_flat`` replaces HF's ``forward`` and
runs the step's flat ragged batch through the backend's causal convolution (the one gated
DeltaNet and Mamba-2 use) over the step's state slots; every weight stays HF's.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from paged_serve.engine.kv.attention_context import current_attention_context
from paged_serve.engine.kv.state_cache import LinearStateShape

SHORT_CONV_LAYER_TYPE = "conv"  # LFM2's layer_types entry


def is_short_conv(module: nn.Module) -> bool:
    """A module built as LFM2's ``ShortConv`` mixers are: ``conv``, ``in_proj`` (three times
    the convolution's channels; an ``nn.Linear`` or the engine's swapped projection) and
    ``out_proj``, numbered by ``layer_idx``."""
    conv, in_proj = getattr(module, "conv", None), getattr(module, "in_proj", None)
    return (
        isinstance(conv, nn.Conv1d)
        and getattr(in_proj, "out_features", None) == 3 * conv.out_channels
        and hasattr(module, "out_proj")
        and hasattr(module, "layer_idx")
    )


def short_conv_layers(model: nn.Module) -> list[nn.Module]:
    """The model's gated short convolutions."""
    return [m for m in model.modules() if is_short_conv(m)]


def short_conv_state_shape(model: nn.Module) -> LinearStateShape | None:
    """The per-sequence state of ``model``'s short convolutions (a window each, no recurrent
    state), or None for a model without them."""
    layers = sorted(short_conv_layers(model), key=lambda m: m.layer_idx)
    if not layers:
        return None
    conv = layers[0].conv
    return LinearStateShape(
        layer_ids=tuple(m.layer_idx for m in layers),
        conv_width=conv.kernel_size[0],
        conv_channels=conv.out_channels,
        recurrent=(0, 0, 0),
    )


def install_short_convs(model: nn.Module) -> int:
    """Point every short convolution's ``forward`` at ``short_conv_flat``; how many swapped."""
    layers = short_conv_layers(model)
    for module in layers:
        module.forward = types.MethodType(short_conv_flat, module)
    return len(layers)


def short_conv_flat(
    self: nn.Module, hidden_states: torch.Tensor, *args: object, **kwargs: object
) -> torch.Tensor:
    """The mixer over the current step's flat batch ``hidden_states [1, T, hidden]``: its
    sequences continue from (and update) their windows; ``[1, T, hidden]``."""
    ctx = current_attention_context()
    window, _ = ctx.state_layer(self.layer_idx, "short-convolution")
    b, c, x = self.in_proj(hidden_states)[0].chunk(3, dim=-1)
    mixed = ctx.backend.causal_conv(
        (b * x).contiguous(),
        self.conv.weight.squeeze(1),
        self.conv.bias,
        window,
        silu=False,
        **ctx.slot_args(),
    )
    return self.out_proj((c * mixed)[None])
