"""Where the Triton kernels can run: compiled on a CUDA device, or interpreted on the CPU.

``@triton.jit`` reads ``TRITON_INTERPRET`` when a kernel module is imported; with it set to
``1`` every kernel runs under Triton's interpreter (numpy on the CPU), which is how the tests
run without a GPU. The launchers and the engine's backend choice ask the same two questions,
answered here once. This module imports no Triton, so the engine may import it before deciding
whether Triton should load at all.
"""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET=1``: kernels run under the interpreter on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def can_run_on(device: torch.device) -> bool:
    """Whether the kernels can take tensors on ``device``: CUDA, or anything interpreted."""
    return device.type == "cuda" or interpreting()


def check_device(device: torch.device) -> None:
    """Raise ``ValueError`` for tensors the kernels cannot take (CPU without the interpreter)."""
    if not can_run_on(device):
        raise ValueError(f"tensors on {device} need TRITON_INTERPRET=1 (or use CUDA tensors)")
