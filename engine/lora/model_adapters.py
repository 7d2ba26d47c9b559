"""The served model's side of LoRA: its projections wrapped with adapter slots, the adapters
read into host memory, and a slot filled with one of them (the runner's side; every
tensor-parallel rank holds its own, filled with its share).

The adaptable projections are the decoder layers' attention and MLP projections by their
Hugging Face names (``ADAPTABLE``), whatever computes them now: our fused ``qkv_proj`` and
``gate_up_proj`` (one wrapper, a part per original projection), a family's own fused ones,
quantized or CPU-kernel modules, a row-parallel projection's local product.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from paged_serve.engine.lora.adapter_files import (
    LoRAAdapter,
    TargetShape,
    read_config,
    read_weights,
)
from paged_serve.engine.lora.config import LoRAConfig
from paged_serve.engine.lora.lora_linear import LoRALinear, Shard
from paged_serve.engine.model.fused_projections import FUSED_GROUPS, FusedLinear, FusedPart
from paged_serve.engine.model.linear_swap import transformer_layers
from paged_serve.engine.model.sharding import RowParallelLinear

logger = logging.getLogger(__name__)

ADAPTABLE = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj", "gate_up_proj"),
}
_ROW_PARALLEL = ("o_proj", "down_proj")

AdapterPairs = dict[str, tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class Target:
    """Where an adapter's matrices for one module path go: a wrapper and its part."""

    wrapper: LoRALinear
    part: int


class ModelAdapters:
    """Wraps ``model``'s adaptable projections (in place) with ``config.max_loras`` slots of
    ``config.max_lora_rank`` lanes each; ``rank``/``world_size``: this tensor-parallel rank."""

    def __init__(
        self,
        model: nn.Module,
        config: LoRAConfig,
        dtype: torch.dtype,
        *,
        rank: int = 0,
        world_size: int = 1,
    ):
        self.config = config
        self.dtype = dtype  # the slots' matrices (the model's dtype)
        self.targets: dict[str, Target] = {}
        self._host: OrderedDict[int, AdapterPairs] = OrderedDict()  # adapter id -> pairs
        layers = transformer_layers(model)
        prefix = next(name for name, module in model.named_modules() if module is layers)
        for index, layer in enumerate(layers):
            for owner_name, names in ADAPTABLE.items():
                owner = getattr(layer, owner_name, None)
                if owner is not None:
                    path = f"{prefix}.{index}.{owner_name}"
                    self._wrap(owner, path, names, dtype, rank, world_size)
        if not self.targets:
            raise ValueError(
                f"{type(model).__name__}: no projection LoRA adapters can adapt (served: the "
                "decoder layers' attention and MLP projections by their usual names)"
            )
        self.shapes = {
            path: TargetShape(*t.wrapper.full_shape(t.part)) for path, t in self.targets.items()
        }

    def _wrap(
        self,
        owner: nn.Module,
        path: str,
        names: tuple[str, ...],
        dtype: torch.dtype,
        rank: int,
        world_size: int,
    ) -> None:
        """Wrap ``owner``'s adaptable projections ``names`` (``path``: the owner's path)."""
        options = {"max_loras": self.config.max_loras, "max_rank": self.config.max_lora_rank}
        for _, group, fused_name in FUSED_GROUPS:
            fused = getattr(owner, fused_name, None)
            if isinstance(fused, FusedLinear) and not isinstance(fused.proj, LoRALinear):
                shard = Shard("rows", rank, world_size) if world_size > 1 else None
                fused.proj = LoRALinear(
                    fused.proj, tuple(fused.sizes), dtype=dtype, shard=shard, **options
                )
                for part, name in enumerate(group):
                    self.targets[f"{path}.{name}"] = Target(fused.proj, part)
        for name in names:
            module = getattr(owner, name, None)
            if module is None or isinstance(module, FusedPart | FusedLinear):
                continue
            if isinstance(module, RowParallelLinear):
                shard = Shard("columns", rank, world_size)
                module.proj = LoRALinear(
                    module.proj, (module.out_features,), dtype=dtype, shard=shard, **options
                )
                self.targets[f"{path}.{name}"] = Target(module.proj, 0)
                continue
            if not isinstance(getattr(module, "out_features", None), int):
                continue
            shard = None
            if world_size > 1:
                shard = Shard("columns" if name in _ROW_PARALLEL else "rows", rank, world_size)
            wrapper = LoRALinear(
                module, (module.out_features,), dtype=dtype, shard=shard, **options
            )
            setattr(owner, name, wrapper)
            self.targets[f"{path}.{name}"] = Target(wrapper, 0)

    def read(self, path: str) -> tuple[int, AdapterPairs]:
        """The adapter folder ``path``'s rank and matrices, checked against this model
        (``AdapterError`` naming what does not fit)."""
        config = read_config(path, self.config.max_lora_rank)
        return config.rank, read_weights(path, config, self.shapes)

    def remember(self, adapter: LoRAAdapter, pairs: AdapterPairs) -> None:
        """Keep ``adapter``'s matrices in host memory (the least recently used beyond
        ``--max-cpu-loras`` are dropped, read again from disk when next needed)."""
        self._host[adapter.id] = pairs
        self._host.move_to_end(adapter.id)
        while len(self._host) > self.config.host_capacity:
            self._host.popitem(last=False)

    @property
    def in_host_memory(self) -> list[int]:
        """Adapter ids read into host memory, least recently used first."""
        return list(self._host)

    def fill(self, slot: int, adapter: LoRAAdapter) -> None:
        """Slot ``slot`` of every wrapped projection holds ``adapter`` (read from host memory,
        or from its folder again)."""
        pairs = self._host.get(adapter.id)
        if pairs is None:
            _, pairs = self.read(adapter.path)
        self.remember(adapter, pairs)
        by_wrapper: dict[int, tuple[LoRALinear, dict]] = {}
        for target in self.targets.values():
            by_wrapper.setdefault(id(target.wrapper), (target.wrapper, {}))
        for path, pair in pairs.items():
            target = self.targets[path]
            by_wrapper[id(target.wrapper)][1][target.part] = pair
        for wrapper, parts in by_wrapper.values():
            wrapper.fill(slot, parts)
        logger.info("LoRA adapter %r (id %d) in slot %d", adapter.name, adapter.id, slot)
