"""One decoder layer's feed-forward block: a gated MLP run op by op, or the family's own block.

A gated MLP (``down(act(gate) * up)``) is the body's own arithmetic over the module's
projections: ours fused (``gate_up_proj``, a ``FusedLinear``), the family's fused (Phi-3's
``gate_up_proj``, gate then up), or apart. A mixture of experts runs the family's own block
(``Qwen3MoeSparseMoeBlock``, ``Qwen2MoeSparseMoeBlock`` with its shared expert, Mixtral's,
OLMoE's): its router and the experts the engine swapped in (engine/model/experts_swap.py) in one
module call, which is where their arithmetic and their tensor-parallel all-reduce already live.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from paged_serve.engine.model.body.family_module import family_forward
from paged_serve.engine.model.fused_projections import FusedLinear


@dataclass(frozen=True, slots=True)
class GatedMLP:
    """``down_proj(act(gate) * up)``; ``gate_up``: one module whose output is ``[gate | up]`` of
    ``sizes`` lanes, or None when ``gate_proj``/``up_proj`` run apart."""

    gate_up: nn.Module | None
    sizes: tuple[int, int]
    gate_proj: nn.Module | None
    up_proj: nn.Module | None
    act: nn.Module
    down_proj: nn.Module

    @classmethod
    def of(cls, mlp: nn.Module) -> GatedMLP:
        gate_up = getattr(mlp, "gate_up_proj", None)
        if isinstance(gate_up, FusedLinear):
            sizes, gate_up = tuple(gate_up.sizes), gate_up.proj
        elif gate_up is not None:  # the family's own (Phi-3): HF chunks it in two halves
            half = gate_up.out_features // 2
            sizes = (half, half)
        else:
            sizes = (0, 0)
        return cls(
            gate_up=gate_up,
            sizes=sizes,
            gate_proj=None if gate_up is not None else mlp.gate_proj,
            up_proj=None if gate_up is not None else mlp.up_proj,
            act=getattr(mlp, "act_fn", None) or mlp.activation_fn,
            down_proj=mlp.down_proj,
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``."""
        if self.gate_up is not None:
            gate, up = self.gate_up(x).split(self.sizes, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        # Phi-3 writes ``up * act(gate)``: a product's bits do not depend on the order.
        return self.down_proj(self.act(gate) * up)


@dataclass(frozen=True, slots=True)
class FamilyBlock:
    """A feed-forward block the family defines (a mixture of experts), through its own forward
    over ``[1, T, hidden]`` as HF's decoder layer calls it."""

    module: nn.Module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``."""
        return family_forward(self.module, x)


def feed_forward_of(mlp: nn.Module) -> GatedMLP | FamilyBlock:
    """A gated MLP when ``mlp`` is one (its projections and activation by HF's names), else the
    family's own block."""
    gated = hasattr(mlp, "down_proj") and (
        hasattr(mlp, "gate_up_proj") or hasattr(mlp, "gate_proj") and hasattr(mlp, "up_proj")
    )
    if gated and (hasattr(mlp, "act_fn") or hasattr(mlp, "activation_fn")):
        return GatedMLP.of(mlp)
    return FamilyBlock(mlp)
