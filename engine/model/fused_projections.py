"""Fuse the projections that read the same input into one GEMM, without forking modeling code.

Hugging Face attention calls ``q_proj(x)``, ``k_proj(x)`` and ``v_proj(x)`` one after another,
and the MLP calls ``gate_proj(x)`` then ``up_proj(x)``: five weight reads and five dispatches
per layer where two would do. At load we concatenate each group's weights (and biases) into one
``FusedLinear`` and put a ``FusedPart`` in place of each original module::

    attn.q_proj ─┐                      x ──► one F.linear ──► [q | k | v]
    attn.k_proj ─┼─► attn.qkv_proj        q_proj(x) computes it and keeps the parts;
    attn.v_proj ─┘                        k_proj(x), v_proj(x) hand out theirs

The modeling code still calls three modules; the first call for an input computes every part
and the others return theirs. A part asked for twice, or for another input (the identity of
``x`` is checked), recomputes, so any call order stays correct, only slower.

Exactness: every output element is the same dot product over the same ``K`` inputs in the same
order, so on the CPU (oneDNN/MKL) the fused GEMM equals the separate ones bit for bit; the tests
check greedy tokens against Hugging Face for every supported family.
"""

from __future__ import annotations

import torch
from torch import nn

from paged_serve.engine.model.linear_swap import transformer_layers
from paged_serve.engine.quant.linear import concat

# (owner attribute, the projections that read one input, the fused module's name)
FUSED_GROUPS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("self_attn", ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
    ("mlp", ("gate_proj", "up_proj"), "gate_up_proj"),
)


def linear_from(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An inference ``nn.Linear`` holding ``weight [out, in]`` and ``bias [out]`` themselves
    (no copy, and no throwaway initialisation of weights that are replaced at once)."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)
    return linear


class FusedLinear(nn.Module):
    """The concatenation of several ``nn.Linear`` that read the same input.

    ``proj`` is one ``nn.Linear`` with weight ``[sum(out_features), in_features]`` and bias
    ``[sum(out_features)]`` or None (a module, so weight-only quantization can swap it like any
    other), or for a checkpoint's quantized projections their ``QuantizedLinear`` joined along
    the outputs (``proj`` given). ``part(i, x)`` is what the ``i``-th original module would
    return for ``x``.
    """

    def __init__(self, linears: list[nn.Module], proj: nn.Module | None = None):
        super().__init__()
        self.sizes = [lin.out_features for lin in linears]
        self.proj = proj if proj is not None else _concatenated(linears)
        # A plain object: nn.Module.__setattr__ costs microseconds, and part() runs 5x a layer.
        self._pending = _PendingParts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """All parts at once: ``[..., sum(out_features)]``."""
        return self.proj(x)

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Part ``index`` of the fused output for ``x`` (a view of one GEMM's result)."""
        pending = self._pending
        if pending.input is not x or index in pending.taken:
            pending.parts = self.forward(x).split(self.sizes, dim=-1)
            pending.input = x
            pending.taken = set()
        pending.taken.add(index)
        out = pending.parts[index]
        if len(pending.taken) == len(self.sizes):  # every part handed out: drop the references
            pending.input, pending.parts = None, ()
        return out


def _concatenated(linears: list[nn.Linear]) -> nn.Linear:
    """One ``nn.Linear`` whose weight and bias are ``linears``' concatenated along the outputs."""
    has_bias = {lin.bias is not None for lin in linears}
    if len(has_bias) != 1:
        raise ValueError("projections to fuse must all have a bias or all have none")
    if len({lin.in_features for lin in linears}) != 1:
        raise ValueError("projections to fuse must read inputs of one size")
    return linear_from(
        torch.cat([lin.weight for lin in linears]),
        torch.cat([lin.bias for lin in linears]) if has_bias.pop() else None,
    )


class _PendingParts:
    """The latest fused output and which of its parts were handed out."""

    __slots__ = ("input", "parts", "taken")

    def __init__(self) -> None:
        self.input: torch.Tensor | None = None
        self.parts: tuple[torch.Tensor, ...] = ()
        self.taken: set[int] = set()


class FusedPart(nn.Module):
    """Stands where one original projection was; returns its slice of the fused GEMM."""

    def __init__(self, fused: FusedLinear, index: int):
        super().__init__()
        # Not registered as a child: the fused weights belong to the owner's fused module only.
        object.__setattr__(self, "fused", fused)
        self.index = index
        self.out_features = fused.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.part(self.index, x)


def fuse_group(owner: nn.Module, names: tuple[str, ...], fused_name: str) -> bool:
    """Fuse ``owner``'s projections ``names`` into ``owner.<fused_name>``; False (unchanged) when
    the owner lacks one of them, one is already fused or quantized by ``--quantization``, or
    they are a checkpoint's quantized projections whose layouts cannot be joined
    (``engine/quant/linear.py``, ``concat``)."""
    linears = [getattr(owner, name, None) for name in names]
    if all(type(lin) is nn.Linear for lin in linears):
        fused = FusedLinear(linears)
    elif (joined := concat(linears)) is not None:
        fused = FusedLinear(linears, joined)
    else:
        return False
    owner.add_module(fused_name, fused)
    for index, name in enumerate(names):
        setattr(owner, name, FusedPart(fused, index))
    return True


@torch.no_grad()
def fuse_projections(model: nn.Module) -> int:
    """Fuse q/k/v and gate/up in every decoder layer of a Hugging Face causal LM, in place (an
    encoder's layers, whose projections have other names, are left as they are).

    Returns the number of groups fused (two per layer for the supported families).
    """
    count = 0
    for layer in transformer_layers(model):
        for owner_name, names, fused_name in FUSED_GROUPS:
            owner = getattr(layer, owner_name, None)
            if owner is not None and fuse_group(owner, names, fused_name):
                count += 1
    return count


@torch.no_grad()
def unfuse_projections(model: nn.Module) -> int:
    """Undo ``fuse_projections`` in place: each group back to its plain ``nn.Linear`` modules
    (tensor parallelism shards those, so a model prepared once can still be sharded).
    Returns the number of groups split."""
    count = 0
    for layer in transformer_layers(model):
        for owner_name, names, fused_name in FUSED_GROUPS:
            owner = getattr(layer, owner_name, None)
            fused = getattr(owner, fused_name, None)
            if not isinstance(fused, FusedLinear) or type(fused.proj) is not nn.Linear:
                continue
            weights = fused.proj.weight.split(fused.sizes)
            biases = fused.proj.bias.split(fused.sizes) if fused.proj.bias is not None else None
            for index, name in enumerate(names):
                bias = biases[index].clone() if biases is not None else None
                setattr(owner, name, linear_from(weights[index].clone(), bias))
            delattr(owner, fused_name)
            count += 1
    return count
