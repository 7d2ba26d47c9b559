"""Swap a mixture-of-experts model's experts for the platform's fused MoE, without forking
modeling code.

transformers dispatches each experts module's forward by name (``config._experts_implementation``)
through its ``ExpertsInterface``, as it dispatches attention; we register ``paged_serve`` there.
The function receives what HF's own forward receives: the layer's flat ``hidden_states [T, H]``,
the router's ``top_k_index`` and ``top_k_weights [T, k]`` (each family's router: softmax top-k
with or without renormalisation, gpt-oss's biased experts), and the module, whose weights it
reads in the layout the module declares (``is_transposed``) and whose own gate it applies
(``_apply_gate``: SwiGLU, gpt-oss's clamped SwiGLU on interleaved columns). The step's kernel
backend computes the pairs: on CUDA the Triton kernel of ``kernels/triton/fused_moe.py``, on the
CPU the grouped pass of ``engine/platform/cpu/moe.py``. Experts a checkpoint stored quantized
(``StoredExperts``, engine/quant/experts.py) reach the Triton kernel as their stored layout and
the grouped pass as modules that dequantize the chosen experts for the call. Under tensor
parallelism each rank holds a slice of every expert's width (engine/model/sharding.py), and the
partial sums are all-reduced here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from transformers import PreTrainedModel
from transformers.integrations.moe import ExpertsInterface

from paged_serve.engine.kv.attention_context import current_attention_context
from paged_serve.engine.model.llama4_moe import install_llama4_moe
from paged_serve.engine.quant.experts import StoredExperts

EXPERTS_NAME = "paged_serve"


def paged_experts_forward(
    module: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """transformers experts function: ``[T, H]``, the routed experts' weighted sum per token."""
    backend = current_attention_context().backend
    w_gate_up, w_down = module.gate_up_proj, module.down_proj
    if module.is_transposed:  # stored [E, in, out]: the kernels take [E, out, in] views
        w_gate_up, w_down = w_gate_up.transpose(1, 2), w_down.transpose(1, 2)
    if backend.name == "triton":  # quantized experts: the kernel reads their stored layout
        w_gate_up, w_down = (
            w.stored if isinstance(w, StoredExperts) else w for w in (w_gate_up, w_down)
        )
    biased = module.has_bias
    out = backend.fused_moe(
        hidden_states,
        w_gate_up,
        w_down,
        top_k_index,
        top_k_weights,
        apply_gate=module._apply_gate,
        gate_up_bias=module.gate_up_proj_bias if biased else None,
        down_bias=module.down_proj_bias if biased else None,
    )
    if getattr(module, "tp_reduce", False):  # sharded experts: each rank holds a partial sum
        dist.all_reduce(out, group=module.tp_group)
    return out


ExpertsInterface.register(EXPERTS_NAME, paged_experts_forward)


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """The modules transformers dispatches as experts (``@use_experts_implementation``)."""
    return [m for m in model.modules() if hasattr(m, "is_transposed") and hasattr(m, "has_gate")]


def install_paged_experts(model: PreTrainedModel) -> int:
    """Point every experts module of ``model`` at the fused MoE; returns how many there are
    (0: a dense model, left as it is). Experts of another shape (no gate/up pair, a norm after
    each expert) keep HF's own forward. Llama 4's mixtures, which transformers does not
    dispatch, get a forward of their own over the fused MoE (``engine/model/llama4_moe.py``)."""
    routed_inputs = install_llama4_moe(model)
    modules = experts_modules(model)
    # transformers 5.17 has no post-expert norms (nor the attribute)
    if not modules or not all(
        m.has_gate and not getattr(m, "has_post_expert_norm", False) for m in modules
    ):
        return routed_inputs
    model.set_experts_implementation(EXPERTS_NAME)
    return routed_inputs + len(modules)


def swap_experts(model: nn.Module, make: Callable[[torch.Tensor], nn.Module | None]) -> int:
    """Replace each gated experts module's ``gate_up_proj`` and ``down_proj`` by
    ``make(weight [E, out, in])`` (a quantized form with ``shape`` and ``linear(x, e, bias)``,
    engine/platform/cpu/moe.py), in place; a module whose weights ``make`` declines (None) stays
    as it is. The module's layout becomes ``[E, out, in]``. Returns how many were swapped."""
    count = 0
    for module in experts_modules(model):
        if not module.has_gate:
            continue
        weights = {name: getattr(module, name) for name in ("gate_up_proj", "down_proj")}
        if module.is_transposed:
            weights = {name: w.transpose(1, 2) for name, w in weights.items()}
        swapped = {name: make(w) for name, w in weights.items()}
        if any(s is None for s in swapped.values()):
            continue
        for name, quantized in swapped.items():
            delattr(module, name)
            setattr(module, name, quantized)
        module.is_transposed = False
        count += 1
    return count
