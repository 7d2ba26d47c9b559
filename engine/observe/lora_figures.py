"""The LoRA figures of an engine snapshot (vLLM's ``lora_requests_info``), in a module of their
own so that ``/metrics``' collector reads their type without importing the engine."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRAFigures:
    """The LoRA adapters at the end of a step: ``running`` and ``waiting`` are (adapter name,
    requests) pairs of the running batch and the waiting queue, by name; ``loaded`` the
    adapters in the device slots; ``max_loras`` the slots (``--max-loras``); ``time`` when
    taken (Unix seconds: vLLM's ``lora_requests_info`` value)."""

    max_loras: int
    running: tuple[tuple[str, int], ...]
    waiting: tuple[tuple[str, int], ...]
    loaded: tuple[str, ...]
    time: float
