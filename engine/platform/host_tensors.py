"""Step metadata from host lists to the device: pinned staging and non-blocking copies."""

from __future__ import annotations

import torch


def host_tensor(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``data`` as a CPU tensor, in page-locked memory when ``device`` is CUDA.

    A copy from pinned memory with ``non_blocking=True`` is a true asynchronous DMA: the host
    goes on building the step while the copy runs. (PyTorch's pinned allocator keeps the buffer
    alive until the copy has finished, so the caller may drop it at once.)
    """
    t = torch.tensor(data, dtype=dtype)
    return t.pin_memory() if device.type == "cuda" else t


def to_device(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``data`` as a tensor on ``device``, copied without blocking the host."""
    return cpu_to_device(host_tensor(data, dtype, device), device)


def cpu_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on ``device``: through pinned memory, without blocking, when that is CUDA."""
    if device.type != "cuda":
        return t
    return (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)
