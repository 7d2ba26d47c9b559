"""How many LoRA adapters the engine serves and how large they may be (vLLM's flags)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """An adapter served from the start (``--lora-modules``): its ``name`` (what a request puts
    in ``model``), its folder ``path`` (peft's ``adapter_config.json`` and
    ``adapter_model.safetensors``) and the name of the model it was trained on, as ``/v1/models``
    reports it (None: the served base model's)."""

    name: str
    path: str
    base_model_name: str | None = None


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """``--enable-lora``'s settings.

    max_loras: adapter slots on the device, so the most distinct adapters one step can run;
    max_lora_rank: the largest rank ``r`` served (every slot holds this many lanes);
    max_cpu_loras: adapters kept read in host memory (least recently used dropped beyond it;
    default ``max_loras``); modules: the adapters loaded at start."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    modules: tuple[LoRAModule, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"max_lora_rank must be in [1, 512], got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )
        names = [m.name for m in self.modules]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules names an adapter twice: {names}")

    @property
    def host_capacity(self) -> int:
        """Adapters kept read in host memory."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras
