"""Kernel backends: which functions run the KV write, paged attention, block copy and the
fused draw.

``torch`` runs the eager references' arithmetic (the CPU default: Triton's interpreter is far too
slow to serve), with each step's metadata derived once rather than per layer
(``engine/platform/cpu/attention.py``), and draws with the eager sampler; ``triton`` runs our
kernels (the CUDA default). Both implement the interface of ``kernels/interface.py``, so a
backend is just its functions. ``engine/platform/platform.py`` chooses one for the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_serve.engine.config import cache_root
from paged_serve.engine.platform.cpu.attention import PlannedTorchAttention
from paged_serve.engine.platform.cpu.linear_attention import causal_conv1d_cpu, gated_delta_rule_cpu
from paged_serve.engine.platform.cpu.lora import add_lora_grouped
from paged_serve.engine.platform.cpu.moe import grouped_moe
from paged_serve.engine.platform.cpu.ssm import ssd_scan_cpu
from paged_serve.kernels import reference
from paged_serve.kernels.cpu import decode_attention as cpu_decode_attention
from paged_serve.kernels.interface import (
    AddLora,
    CausalConv,
    CopyBlocks,
    FusedMoe,
    FusedSample,
    GatedDeltaRule,
    LoraSegments,
    MlaAttention,
    PagedAttention,
    SsdScan,
    WriteKv,
    WriteLatent,
)


@dataclass(frozen=True, slots=True)
class KernelBackend:
    """The functions a step calls (``kernels/interface.py``); ``fused_moe`` runs the routed
    experts of a mixture-of-experts layer (``engine/model/experts_swap.py``); ``write_latent``
    and ``mla_attention`` serve multi-head latent attention layers
    (``engine/model/latent_attention.py``); ``causal_conv`` and ``gated_delta_rule`` serve
    gated DeltaNet layers over their state slots (``engine/model/linear_attention.py``), and
    ``causal_conv`` and ``ssd_scan`` Mamba-2 layers (``engine/model/mamba_mixer.py``);
    ``add_lora`` adds each token's LoRA adapter to a projection (``engine/lora/``).
    ``sample`` is the
    fused draw (``kernels/triton/sampling.py``), or None for the eager one; ``graph_safe``: the
    functions can be captured in a CUDA graph."""

    name: str
    write_kv: WriteKv
    paged_attention: PagedAttention
    copy_blocks: CopyBlocks
    fused_moe: FusedMoe
    write_latent: WriteLatent
    mla_attention: MlaAttention
    causal_conv: CausalConv
    gated_delta_rule: GatedDeltaRule
    add_lora: AddLora
    ssd_scan: SsdScan
    sample: FusedSample | None = None
    graph_safe: bool = False


def fused_sampler(name: str) -> FusedSample | None:
    """The fused draw of backend ``name`` (triton), or None (torch: the eager draw)."""
    if name == "triton":
        from paged_serve.kernels.triton.sampling import (
            sample,  # imported here, as the kernels below
        )

        return sample
    return None


def add_lora_kernels(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    token_slots: torch.Tensor,
    first_slot: int,
    num_slots: int,
    mask: torch.Tensor | None,
    segments: LoraSegments | None,
) -> None:
    """``AddLora`` on the Triton kernels: shrink every token by its slot's ``A``, expand by its
    ``B`` into ``y`` (``kernels/triton/lora.py``; a token of slot -1 exits at once). Reads
    ``token_slots`` only, so a CUDA graph replays it for any mix of slots."""
    from paged_serve.kernels.triton.lora import lora_expand, lora_shrink

    lora_expand(lora_shrink(x, a, token_slots), b, token_slots, y)


def make_kernels(
    name: str, *, group_alone: bool = False, decode_kernel: bool = True
) -> KernelBackend:
    """``group_alone``: the torch backend attends a decode row alone in the grouped layout
    (``UniformGroup``), 3-4.5x faster in bf16, instead of Hugging Face's, which gives HF's own
    bf16 tokens. ``decode_kernel``: the torch backend runs decode-only steps with the CPU C
    kernel (``kernels/cpu/decode_attention.py``), built at first use, where it builds."""
    if name == "torch":
        # One per runner: it remembers the current step.
        kernel = cpu_decode_attention.load(cache_root()) if decode_kernel else None
        planned = PlannedTorchAttention(group_alone=group_alone, decode_kernel=kernel)
        return KernelBackend(
            name,
            planned.write_kv,
            planned.paged_attention,
            reference.copy_blocks_ref,
            grouped_moe,
            reference.write_latent_ref,
            reference.mla_attention_ref,
            causal_conv1d_cpu,
            gated_delta_rule_cpu,
            add_lora_grouped,
            ssd_scan_cpu,
        )
    if name == "triton":
        # Imported here: triton must not load before TRITON_INTERPRET is decided.
        from paged_serve.kernels.triton.block_copy import copy_blocks
        from paged_serve.kernels.triton.causal_conv import causal_conv1d
        from paged_serve.kernels.triton.delta_rule import gated_delta_rule
        from paged_serve.kernels.triton.fused_moe import fused_moe
        from paged_serve.kernels.triton.kv_write import write_kv, write_latent
        from paged_serve.kernels.triton.mla_attention import mla_attention
        from paged_serve.kernels.triton.paged_attention import paged_attention
        from paged_serve.kernels.triton.ssd_scan import ssd_scan

        sample = fused_sampler(name)
        return KernelBackend(
            name,
            write_kv,
            paged_attention,
            copy_blocks,
            fused_moe,
            write_latent,
            mla_attention,
            causal_conv1d,
            gated_delta_rule,
            add_lora_kernels,
            ssd_scan,
            sample,
            graph_safe=True,
        )
    raise ValueError(f"unknown attention backend {name!r}")
