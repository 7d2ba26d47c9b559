"""Attention backends: which functions run the KV write, paged attention and block copy.

``torch`` runs the eager references' arithmetic (the CPU default: Triton's interpreter is far too
slow to serve), with each step's metadata derived once rather than per layer
(``engine/platform/cpu/attention.py``); ``triton`` runs our kernels (the CUDA default). Both sets
of functions share one keyword signature, so a backend is just the three functions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.model.loader import cache_root
from engine.platform.cpu.attention import PlannedTorchAttention
from kernels import reference
from kernels.cpu import decode_attention as cpu_decode_attention
from kernels.triton.runtime import can_run_on


@dataclass(frozen=True, slots=True)
class AttentionBackend:
    """The functions a step calls (signatures: see ``kernels/reference.py``)."""

    name: str
    write_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    copy_blocks: Callable[..., None]


def resolve_backend_name(requested: str, device: torch.device) -> str:
    """``auto`` is triton on CUDA and torch elsewhere; triton on CPU needs the interpreter."""
    if requested == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if requested == "triton" and not can_run_on(device):
        raise ValueError(
            "the triton backend on a CPU needs TRITON_INTERPRET=1 (and is slow): "
            "use --attention-backend torch"
        )
    return requested


def make_backend(
    name: str, *, group_alone: bool = False, decode_kernel: bool = True
) -> AttentionBackend:
    """``group_alone``: the torch backend attends a decode row alone in the grouped layout
    (``UniformGroup``), 3-4.5x faster in bf16, instead of Hugging Face's, which gives HF's own
    bf16 tokens. ``decode_kernel``: the torch backend runs decode-only steps with the CPU C
    kernel (``kernels/cpu/decode_attention.py``), built at first use, where it builds."""
    if name == "torch":
        # One per runner: it remembers the current step.
        kernel = cpu_decode_attention.load(cache_root()) if decode_kernel else None
        planned = PlannedTorchAttention(group_alone=group_alone, decode_kernel=kernel)
        return AttentionBackend(
            name, planned.write_kv, planned.paged_attention, reference.copy_blocks_ref
        )
    if name == "triton":
        # Imported here: triton must not load before TRITON_INTERPRET is decided.
        from kernels.triton.block_copy import copy_blocks
        from kernels.triton.kv_write import write_kv
        from kernels.triton.paged_attention import paged_attention

        return AttentionBackend(name, write_kv, paged_attention, copy_blocks)
    raise ValueError(f"unknown attention backend {name!r}")
