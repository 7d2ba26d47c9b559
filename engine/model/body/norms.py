"""The RMSNorm of the decoder families the body runs, with Hugging Face's bits."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# HF's RMSNorm classes whose weight multiplies before the cast back to the input's dtype.
WEIGHT_IN_FP32 = ("Olmo2RMSNorm", "GptOssRMSNorm")
# Gemma's and Qwen3-Next's and Qwen3.5's: the same in fp32, by ``1 + weight`` (their weights are
# stored as offsets from 1).
OFFSET_FROM_ONE = (
    "Gemma2RMSNorm",
    "Gemma3RMSNorm",
    "Qwen3NextRMSNorm",
    "Qwen3_5RMSNorm",
    "Qwen3_5MoeRMSNorm",
)


@dataclass(frozen=True, slots=True)
class RMSNorm:
    """An HF RMSNorm's weight and epsilon (``LlamaRMSNorm`` and its copies in the families).

    ``weight_in_fp32``: the weight multiplies the fp32 normalised values before the cast back
    (OLMo 2's, gpt-oss's and Gemma's norms), not after it (Llama's and the other families'); the
    same bits in fp32, another rounding in bf16. Gemma's weight is ``1 + weight`` in fp32,
    computed once here as its HF forward computes it per call.
    """

    weight: torch.Tensor
    eps: float
    fused: bool  # the platform's F.rms_norm has HF's bits (checked on the CPU)
    weight_in_fp32: bool = False

    @classmethod
    def of(cls, norm: nn.Module, fused: bool) -> RMSNorm:
        """``norm``'s weight and epsilon; ``fused``: ``Platform.fused_rms_norm`` of its device."""
        kind = type(norm).__name__
        if kind in OFFSET_FROM_ONE:
            return cls(1.0 + norm.weight.detach().float(), norm.eps, fused, weight_in_fp32=True)
        return cls(norm.weight, norm.variance_epsilon, fused, kind in WEIGHT_IN_FP32)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """HF's values: ``weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)``, ``x32`` being x
        in fp32.

        On the CPU ``F.rms_norm`` computes the fp32 part with the same bits as HF's five ops
        (tested), in fewer ops: about 2.4 (bf16) and 5.5 (fp32) us less for a 576-wide row
        (docs/measurements/cpu-kernels.md). In fp32 it takes the weight too (the same product); in
        bf16 the weight comes after the cast, as in HF, since ``F.rms_norm`` with a bf16 weight
        rounds once where HF rounds twice. Its bits were checked on the CPU only, so other devices
        run
        ``hf_ops``."""
        if not self.fused:
            return self.hf_ops(x)
        dtype, width = x.dtype, (x.shape[-1],)
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, width, self.weight, self.eps)
        normed = F.rms_norm(x.to(torch.float32), width, eps=self.eps)
        if self.weight_in_fp32:
            return (self.weight * normed).to(dtype)
        return self.weight * normed.to(dtype)

    def hf_ops(self, x: torch.Tensor) -> torch.Tensor:
        """HF's arithmetic, op for op."""
        dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.eps)
        if self.weight_in_fp32:
            return (self.weight * h).to(dtype)
        return self.weight * h.to(dtype)


@dataclass(frozen=True, slots=True)
class ModuleNorm:
    """A norm the body does not reimplement (Cohere's LayerNorm: mean removed, no bias, per-head
    weights for its QK norms), through the module's own forward."""

    module: nn.Module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


Norm = RMSNorm | ModuleNorm


def norm_of(norm: nn.Module, fused: bool) -> Norm:
    """``RMSNorm`` for the families' RMSNorms (every class named ``*RMSNorm``), else the module."""
    if type(norm).__name__.endswith("RMSNorm"):
        return RMSNorm.of(norm, fused)
    return ModuleNorm(norm)
