"""Which dtype ``--dtype auto`` loads the weights in, and why (logged at start).

CUDA: bfloat16. CPU: bfloat16 where the CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16),
float32 elsewhere. On this project's 2-core AVX512-BF16 box a bf16 decode step of the default
model is 1.35x (8 streams) to 1.5x (24 streams) faster than fp32, each on its fastest kernels,
and about as fast at 1 stream (31.3 against 28.0 ms: there fp32's column split streams its
weights faster than oneDNN streams bf16's; docs/measurements/cpu-kernels.md, "Where a decode step
goes"), while a CPU without those instructions would convert every bf16 weight to fp32 on the fly
and gain nothing.
``--dtype float32`` keeps the exact equality with Hugging Face fp32 ``generate``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# torch.cpu.get_capabilities() keys that mean bf16 dot products run in hardware.
NATIVE_BF16_FEATURES = ("avx512_bf16", "amx_bf16")


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    """The weights' dtype and the reason for it, in words for the start-up log."""

    dtype: torch.dtype
    reason: str

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')} ({self.reason})"


def native_bf16_features() -> tuple[str, ...]:
    """The native-bf16 instruction sets this CPU has (empty when none, or unknown)."""
    try:
        caps = torch.cpu.get_capabilities()
    except (AttributeError, RuntimeError):  # older torch or no cpuinfo: assume none
        return ()
    return tuple(name for name in NATIVE_BF16_FEATURES if caps.get(name))


def choose_dtype(dtype: str, device: torch.device) -> DtypeChoice:
    """Resolve ``dtype`` (``auto`` or a torch dtype name) for ``device``."""
    if dtype != "auto":
        return DtypeChoice(getattr(torch, dtype), "asked for")
    if device.type == "cuda":
        return DtypeChoice(torch.bfloat16, "auto: CUDA")
    features = native_bf16_features()
    if features:
        return DtypeChoice(
            torch.bfloat16,
            f"auto: this CPU has native bf16 ({', '.join(features)}); "
            "--dtype float32 for results equal to Hugging Face fp32",
        )
    return DtypeChoice(torch.float32, "auto: this CPU has no native bf16")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The torch dtype ``choose_dtype`` picks."""
    return choose_dtype(dtype, device).dtype
