"""Where the Triton kernels can run: compiled on a CUDA device, or interpreted on the CPU.

``@triton.jit`` reads ``TRITON_INTERPRET`` when a kernel module is imported; with it set to
``1`` every kernel runs under Triton's interpreter (numpy on the CPU), which is how the tests
run without a GPU. The launchers and the engine's backend choice ask the same two questions,
answered here once. This module imports no Triton, so the engine may import it before deciding
whether Triton should load at all.
"""

from __future__ import annotations

import functools
import os

import torch

# Streaming multiprocessors the launch heuristics plan for where there is no GPU to ask (an H100
# or H200 SXM: the GPUs this project is measured on), so interpreted runs choose what they would.
REFERENCE_SMS = 132


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


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessor_count(device: torch.device) -> int:
    """The streaming multiprocessors of ``device`` (CUDA), else ``REFERENCE_SMS``."""
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    return REFERENCE_SMS


# Fused split-KV merges count finished splits on int32 tickets that each launch leaves at zero.
# One pool per device, grown by replacement; replaced pools stay referenced, because CUDA
# graphs captured with them keep their addresses.
_MIN_TICKETS = 4096
_TICKETS: dict[torch.device, torch.Tensor] = {}
_RETIRED_TICKETS: list[torch.Tensor] = []


def zeroed_tickets(device: torch.device, count: int) -> torch.Tensor:
    """``count`` int32 counters on ``device``, all zero: the start of the device's pool.

    The kernels that take them set each one back to zero before they finish, so the pool is
    zero between launches. Launches on one device share it: they must be ordered (one stream,
    as the engine runs), never concurrent.
    """
    pool = _TICKETS.get(device)
    if pool is None or pool.numel() < count:
        if pool is not None:
            _RETIRED_TICKETS.append(pool)
        size = max(_MIN_TICKETS, 1 << max(0, count - 1).bit_length())
        pool = _TICKETS[device] = torch.zeros(size, dtype=torch.int32, device=device)
    return pool[:count]
