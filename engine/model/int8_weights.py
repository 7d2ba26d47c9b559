"""Weight-only int8 on the CPU: the projections' weights as int8 with one scale per output row.

Decoding one token reads every weight once, so a step at low concurrency costs what the weight
bytes cost to stream from memory: int8 weights are a quarter of fp32 and half of bf16. Each
``nn.Linear`` in the decoder layers (fused ones included) and the LM head becomes an
``Int8Linear``: ``weight ≈ qweight * scale[:, None]`` with ``qweight = round(weight / scale)``
in [-127, 127] and ``scale = max|row| / 127``. torch's CPU kernel (``aten._weight_int8pack_mm``)
multiplies bf16 activations by the int8 rows and then by the scales; the input is rounded to
bf16 for it and the output returned in the input's dtype, because the kernel's fp32 path is the
slow one (30 layers' projections at 1 token, 2 threads: 65.9 ms with fp32 activations, 11.1 ms
with bf16, against 38.9 ms fp32 and 20.8 ms bf16 unquantized; docs/measurements/cpu-kernels.md). The
embeddings stay as they are (a lookup reads one row per token).

This is an approximation of the model, not the model: the tokens differ from Hugging Face's
(bf16 + int8: 0 of 4 prompts exact, 21.6 % of greedy tokens agreeing, in the
serving run recorded in `git show c3a5cfe^:docs/performance.md`).
"""

from __future__ import annotations

import torch
from torch import nn

from paged_serve.engine.model.experts_swap import swap_experts
from paged_serve.engine.model.linear_swap import swap_linears
from paged_serve.engine.platform.platform import Platform


class Int8Linear(nn.Module):
    """``y = bf16(x) @ (qweight * scale[:, None]).T + bias`` for ``x [..., in_features]``, in
    x's dtype."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        qweight, scale = int8_rows(linear.weight)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("qweight", qweight)  # [out, in] int8
        self.register_buffer("scale", scale)  # [out] bf16
        self.bias = linear.bias

    def dequantized(self) -> torch.Tensor:
        """The weight this module multiplies by, ``[out_features, in_features]`` in fp32."""
        return self.qweight.float() * self.scale.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scale)
        y = y.view(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [..., out, in]`` as int8 rows and one bf16 scale per row (``max|row| / 127``,
    quantized against the bf16 scale the kernel multiplies by)."""
    weight = weight.detach().float()
    scale = weight.abs().amax(dim=-1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0
    scale = scale.to(torch.bfloat16).float()
    qweight = torch.round(weight / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return qweight.contiguous(), scale.to(torch.bfloat16)


class Int8Experts(nn.Module):
    """One projection of every expert of a mixture-of-experts layer, ``[E, out, in]``, as int8
    rows with a bf16 scale each: ``linear(x, e)`` is ``Int8Linear``'s arithmetic for expert
    ``e`` (engine/platform/cpu/moe.py calls it for the experts a step chose)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        qweight, scale = int8_rows(weight)
        self.register_buffer("qweight", qweight)  # [E, out, in] int8
        self.register_buffer("scale", scale)  # [E, out] bf16

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    def dequantized(self) -> torch.Tensor:
        """The weights this module multiplies by, ``[E, out, in]`` in fp32."""
        return self.qweight.float() * self.scale.float()[..., None]

    def linear(
        self, x: torch.Tensor, expert: int, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``bf16(x [N, in]) @ W_e^T + bias``, in x's dtype."""
        rows = x.to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int8pack_mm(rows, self.qweight[expert], self.scale[expert])
        y = y.to(x.dtype)
        return y if bias is None else y + bias


@torch.no_grad()
def quantize_int8(model: nn.Module, platform: Platform) -> int:
    """Swap every ``nn.Linear`` of the decoder layers and the LM head for ``Int8Linear``, and
    every mixture-of-experts layer's experts for ``Int8Experts``, in place; returns how many
    projections were swapped (an experts module counts once). Raises ValueError where
    ``platform`` (the model's device's) does not run it: off the CPU (the kernel is torch's
    CPU one)."""
    platform.check_quantization("int8")
    # The LM head is untied from the embeddings, which stay as they are.
    return swap_linears(model, Int8Linear) + swap_experts(model, Int8Experts)
