"""Loading and unloading adapters while the engine serves (the server's
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``), never holding the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from paged_serve.engine.lora.adapter_files import LoRAAdapter
from paged_serve.engine.lora.registry import LoRARegistry, ReadAdapter

if TYPE_CHECKING:
    from paged_serve.engine.llm_engine import LLMEngine

BetweenSteps = Callable[[], AbstractContextManager["LLMEngine"]]


class AsyncAdapters:
    """The engine's ``registry`` from an event loop; ``between_steps`` holds the engine thread
    between two steps (``EngineLoop.between_steps``)."""

    def __init__(self, registry: LoRARegistry, between_steps: BetweenSteps):
        self.registry = registry
        self._between_steps = between_steps

    def served(self) -> list[LoRAAdapter]:
        """The adapters served now, in load order."""
        return self.registry.served()

    def get(self, name: str) -> LoRAAdapter | None:
        return self.registry.get(name)

    async def load(
        self,
        name: str,
        path: str,
        base_model_name: str | None = None,
        *,
        reserved: frozenset[str] = frozenset(),
    ) -> LoRAAdapter:
        """Serve the adapter folder ``path`` as ``name`` from the next step: its files read and
        checked in a worker thread, then registered between two steps. AdapterError naming
        what does not fit, or a name already served (or one of ``reserved``, the names the
        server gives the base model)."""
        read = await asyncio.to_thread(self.registry.read, name, path, base_model_name)
        return await asyncio.to_thread(self._register, read, reserved)

    def _register(self, read: ReadAdapter, reserved: frozenset[str]) -> LoRAAdapter:
        with self._between_steps() as engine:
            return self.registry.add(read, reserved=reserved | {engine.model_name})

    async def unload(self, name: str) -> LoRAAdapter:
        """Stop serving ``name`` (KeyError when no adapter is served by that name); the requests
        already accepted on it finish on it."""
        return await asyncio.to_thread(self._unregister, name)

    def _unregister(self, name: str) -> LoRAAdapter:
        with self._between_steps():
            return self.registry.remove(name)
