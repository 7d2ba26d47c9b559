"""The adapters served by name: what a request's ``model`` may name besides the base model.

Loading reads and checks the adapter's files against the served model (``ModelAdapters.read``:
no engine state is touched, so the server runs it in a worker thread) and then registers it
under a fresh id (``add``, between two steps). Unloading takes the name away at once; the
requests already accepted on it finish on it (``AdapterSlots.retire``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from paged_serve.engine.errors import InvalidRequestError
from paged_serve.engine.lora.adapter_files import AdapterError, LoRAAdapter
from paged_serve.engine.lora.adapter_slots import AdapterSlots
from paged_serve.engine.lora.config import LoRAConfig
from paged_serve.engine.lora.model_adapters import AdapterPairs, ModelAdapters

if TYPE_CHECKING:
    from paged_serve.engine.config import EngineConfig


@dataclass(frozen=True, slots=True)
class ReadAdapter:
    """An adapter's files read and checked, not yet registered."""

    name: str
    path: str
    rank: int
    pairs: AdapterPairs
    base_model_name: str | None


class LoRARegistry:
    """Served adapters by name, over the model's wrapped projections (``adapters``) and the
    scheduler's slots (``slots``)."""

    def __init__(self, config: LoRAConfig, adapters: ModelAdapters, slots: AdapterSlots):
        self.config = config
        self.adapters = adapters
        self.slots = slots
        self._by_name: dict[str, LoRAAdapter] = {}
        self._ids = itertools.count(1)

    def read(self, name: str, path: str, base_model_name: str | None = None) -> ReadAdapter:
        """Read and check the adapter folder ``path`` (AdapterError naming what does not fit);
        touches no engine state."""
        if not name or not isinstance(name, str):
            raise AdapterError(f"an adapter needs a non-empty name, got {name!r}")
        rank, pairs = self.adapters.read(path)
        return ReadAdapter(name, str(path), rank, pairs, base_model_name)

    def add(self, read: ReadAdapter, *, reserved: frozenset[str] = frozenset()) -> LoRAAdapter:
        """Serve ``read`` under its name (AdapterError if the name is taken, by another adapter
        or one of ``reserved``, the base model's names)."""
        if read.name in self._by_name or read.name in reserved:
            raise AdapterError(f"the name {read.name!r} is already served")
        adapter = LoRAAdapter(
            next(self._ids), read.name, read.path, read.rank, read.base_model_name
        )
        self.adapters.remember(adapter, read.pairs)
        self._by_name[read.name] = adapter
        return adapter

    def remove(self, name: str) -> LoRAAdapter:
        """Stop serving ``name`` (KeyError if it is not served)."""
        adapter = self._by_name.pop(name)
        self.slots.retire(adapter.id)
        return adapter

    def get(self, name: str) -> LoRAAdapter | None:
        return self._by_name.get(name)

    def served(self) -> list[LoRAAdapter]:
        """The served adapters, in the order they were loaded."""
        return sorted(self._by_name.values(), key=lambda a: a.id)


def lora_registry(
    config: EngineConfig, adapters: ModelAdapters | None, *, reserved: set[str]
) -> LoRARegistry | None:
    """The engine's registry (None without ``--enable-lora``), with the adapters of
    ``--lora-modules`` loaded; ``reserved``: the names of the base model, which no adapter
    may take. ValueError for LoRA on a pooling model (only generating models take adapters)."""
    if config.lora is None:
        return None
    if config.runner == "pooling" or adapters is None:
        raise ValueError("LoRA adapters are served on text-generation models (--runner generate)")
    registry = LoRARegistry(config.lora, adapters, AdapterSlots(config.lora.max_loras))
    for module in config.lora.modules:
        read = registry.read(module.name, module.path, module.base_model_name)
        registry.add(read, reserved=frozenset(reserved))
    return registry


def lora_adapter(registry: LoRARegistry | None, name: str) -> LoRAAdapter:
    """The served adapter ``name``; InvalidRequestError naming ``model`` when none is."""
    adapter = None if registry is None else registry.get(name)
    if adapter is None:
        served = (
            "none (--enable-lora is off)"
            if registry is None
            else [a.name for a in registry.served()]
        )
        raise InvalidRequestError(f"no LoRA adapter {name!r} is served (served: {served})", "model")
    return adapter
