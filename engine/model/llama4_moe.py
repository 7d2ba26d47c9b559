"""Llama 4's mixture of experts on the backend's fused MoE, without forking modeling code.

``Llama4TextMoe`` does not dispatch its experts through transformers' ``ExpertsInterface``, and
its forward runs every expert over every token: the router keeps each token's top-k logits,
their sigmoids scale the token's *input* to those experts (0 for the others), and all ``E``
experts run on the scaled copies (``E`` times the routed work). ``install_llama4_moe`` swaps
its ``forward`` for one that sends each token to its chosen experts only, through the step
backend's ``fused_moe`` (the Triton kernel on CUDA, the grouped pass on the CPU), with the
router's sigmoid applied to the input and a routing weight of 1, the shared expert added as HF
adds it. An expert fed a zero input gives exactly zero (SiLU(0) * 0), so the experts skipped
are the ones that added nothing.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from paged_serve.engine.kv.attention_context import current_attention_context

LLAMA4_MOE = "Llama4TextMoe"


def llama4_moe_forward(module: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``Llama4TextMoe.forward`` over the flat batch: ``hidden_states [..., H]`` in, ``(out [T,
    H], router_logits [T, E])`` out, as HF's."""
    x = hidden_states.reshape(-1, module.hidden_dim)
    scores, logits = module.router(x)  # scores [T, E]: the top-k logits' sigmoids, else 0
    chosen = torch.topk(logits, module.top_k, dim=1).indices  # [T, k], HF's choice
    input_scales = scores.gather(1, chosen)  # [T, k]
    experts = module.experts
    w_gate_up = experts.gate_up_proj.transpose(1, 2)  # [E, H, 2I] -> [E, 2I, H]
    w_down = experts.down_proj.transpose(1, 2)  # [E, I, H] -> [E, H, I]
    width = experts.expert_dim

    def apply_gate(gate_up: torch.Tensor) -> torch.Tensor:
        """HF's gate: ``[S, 2I]`` (gate, then up) -> ``up * act(gate) [S, I]``."""
        return gate_up[:, width:] * experts.act_fn(gate_up[:, :width])

    backend = current_attention_context().backend
    ones = torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)
    out = module.shared_expert(x)
    for j in range(module.top_k):  # each choice has its own scaled input
        out.add_(
            backend.fused_moe(
                x * input_scales[:, j : j + 1],
                w_gate_up,
                w_down,
                chosen[:, j : j + 1].contiguous(),
                ones,
                apply_gate=apply_gate,
            )
        )
    return out, logits


def install_llama4_moe(model: nn.Module) -> int:
    """Point every ``Llama4TextMoe`` of ``model`` at ``llama4_moe_forward``, in place; returns
    how many there are."""
    modules = [m for m in model.modules() if type(m).__name__ == LLAMA4_MOE]
    for module in modules:
        module.forward = types.MethodType(llama4_moe_forward, module)
    return len(modules)
