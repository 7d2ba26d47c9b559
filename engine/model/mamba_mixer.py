"""Mamba-2 token mixers (Bamba, Granite 4.0 hybrid, Nemotron-H, Falcon-H1, Mamba-2) over
per-sequence state slots.

Every Mamba-2 family in transformers builds its mixer the same way: one input projection
``in_proj`` whose output splits into a gate ``z [I]``, the convolution's input ``xBC [I + 2 G
N]`` and a step size per head ``dt [H]``; a depthwise causal convolution ``conv1d`` over
``xBC`` (SiLU); the selective state-space scan of ``x [H, P]`` with ``B``, ``C [G, N]``,
``A = -exp(A_log)``, ``dt = softplus(dt + dt_bias)`` clamped to ``time_step_limit`` and the skip
``D``; a gated RMSNorm ``norm(y, z)`` (grouped by ``n_groups``) and ``out_proj``. HF's module
runs a padded batch with a ``Cache`` object; ``mamba2_flat`` replaces its ``forward`` and runs
the step's flat ragged batch, keeping every weight and sub-module of HF's and swapping only the
two stateful operations for the backend's kernels over the step's state slots: the causal
convolution (the one gated DeltaNet uses) and the scan (``SsdScan``,
``kernels/reference.py``'s ``ssd_scan_ref`` defines it).

Falcon-H1's mixer adds two multipliers (``ssm_in_multiplier`` on the input, ``mup_vector`` on the
projection) and may skip the norm (``mamba_rms_norm`` off: ``y * silu(z)``); both are read from
the module when present. The state shape comes from the modules too, so a family is found by
its mixer's structure rather than by its config's names.
"""

from __future__ import annotations

import math
import types

import torch
import torch.nn.functional as F
from torch import nn

from paged_serve.engine.kv.attention_context import current_attention_context
from paged_serve.engine.kv.state_cache import LinearStateShape

MIXER_PARTS = ("in_proj", "conv1d", "A_log", "dt_bias", "D", "norm", "out_proj")
MIXER_SIZES = ("num_heads", "head_dim", "ssm_state_size", "n_groups", "intermediate_size")


def is_mamba2_mixer(module: nn.Module) -> bool:
    """A module built as transformers' Mamba-2 mixers are (or already swapped)."""
    parts = all(hasattr(module, p) for p in (*MIXER_PARTS, *MIXER_SIZES, "layer_idx"))
    return parts and isinstance(getattr(module, "conv1d", None), nn.Conv1d)


def mamba2_layers(model: nn.Module) -> list[nn.Module]:
    """The model's Mamba-2 mixers."""
    return [m for m in model.modules() if is_mamba2_mixer(m)]


def unservable_mixer_reason(module: nn.Module) -> str | None:
    """Why a Mamba-2 mixer cannot run on the state slots; None when it can."""
    if getattr(module, "activation", "silu") not in ("silu", "swish"):
        return f"its convolution's activation is {module.activation!r}; the kernels apply SiLU"
    extra = module.in_proj.out_features - _projection_width(module)
    if extra:
        return f"its in_proj has {extra} outputs beyond z, xBC and dt (a gated MLP beside the SSM)"
    return None


def _projection_width(module: nn.Module) -> int:
    """``in_proj``'s outputs: ``z [I]``, ``xBC [I + 2 G N]``, ``dt [H]``."""
    return 2 * module.intermediate_size + _bc_width(module) + module.num_heads


def _bc_width(module: nn.Module) -> int:
    return 2 * module.n_groups * module.ssm_state_size


def mamba_state_shape(model: nn.Module) -> LinearStateShape | None:
    """The per-sequence state of ``model``'s Mamba-2 mixers (their convolution window and ``[H,
    P, N]`` SSM state), or None for a model without them."""
    layers = sorted(mamba2_layers(model), key=lambda m: m.layer_idx)
    if not layers:
        return None
    first = layers[0]
    return LinearStateShape(
        layer_ids=tuple(m.layer_idx for m in layers),
        conv_width=first.conv1d.kernel_size[0],
        conv_channels=first.intermediate_size + _bc_width(first),
        recurrent=(first.num_heads, first.head_dim, first.ssm_state_size),
    )


def install_mamba2_mixers(model: nn.Module) -> int:
    """Point every Mamba-2 mixer's ``forward`` at ``mamba2_flat``; how many were swapped."""
    layers = mamba2_layers(model)
    for module in layers:
        module.forward = types.MethodType(mamba2_flat, module)
    return len(layers)


def _step_sizes(module: nn.Module, dt: torch.Tensor) -> torch.Tensor:
    """``softplus(dt + dt_bias)`` clamped to the module's ``time_step_limit``, fp32 ``[T, H]``
    (the projection's raw ``dt`` in; the bias added in the model's dtype, as HF does)."""
    dt = F.softplus(dt + module.dt_bias.to(dt.dtype)).float()
    low, high = getattr(module, "time_step_limit", (0.0, math.inf))
    if low > 0.0 or high != math.inf:
        dt = dt.clamp(min=low, max=high)
    return dt


def mamba2_flat(
    self: nn.Module, hidden_states: torch.Tensor, *args: object, **kwargs: object
) -> torch.Tensor:
    """The mixer over the current step's flat batch ``hidden_states [1, T, hidden]``: its
    sequences continue from (and update) their state slots; ``[1, T, hidden]``."""
    ctx = current_attention_context()
    conv_state, ssm_state = ctx.state_layer(self.layer_idx, "Mamba-2")
    num_tokens, dtype = hidden_states.shape[1], hidden_states.dtype
    heads, groups, state_size = self.num_heads, self.n_groups, self.ssm_state_size
    multiplier = getattr(self, "ssm_in_multiplier", None)  # Falcon-H1
    if multiplier is not None:
        hidden_states = hidden_states * multiplier
    projected = self.in_proj(hidden_states)[0]
    mup = getattr(self, "mup_vector", None)  # Falcon-H1
    if mup is not None:
        projected = projected * mup.reshape(-1)
    gate, xbc, dt = projected.split(
        [self.intermediate_size, self.intermediate_size + _bc_width(self), heads], dim=-1
    )
    slots = ctx.slot_args()
    xbc = ctx.backend.causal_conv(
        xbc.contiguous(), self.conv1d.weight.squeeze(1), self.conv1d.bias, conv_state, **slots
    )
    x, b, c = xbc.split([self.intermediate_size, groups * state_size, groups * state_size], -1)
    y = ctx.backend.ssd_scan(
        x.unflatten(-1, (heads, self.head_dim)),
        _step_sizes(self, dt),
        -self.A_log.float().exp(),
        b.unflatten(-1, (groups, state_size)),
        c.unflatten(-1, (groups, state_size)),
        self.D,
        ssm_state,
        max_seqlen_q=ctx.max_seqlen_q,
        **slots,
    ).reshape(1, num_tokens, self.intermediate_size)
    if getattr(self, "mamba_rms_norm", True):
        y = self.norm(y, gate[None])
    else:  # Falcon-H1 without the mixer's norm
        y = y * F.silu(gate[None])
    return self.out_proj(y.to(dtype))
