"""Load a checkpoint stored quantized (GPTQ, AWQ, compressed-tensors, fine-grained FP8) with its
projections kept in their stored precision, never through a full-precision copy.

    config.json ──► checkpoint_quantization: the reading instructions (refusals before any read)
                ──► the model on the meta device, built from the config without its
                    quantization_config (transformers would look for GPTQModel, AutoAWQ, ...)
    *.safetensors ─► each decoder-layer nn.Linear stored quantized: a QuantizedLinear holding
                    the stored codes in the kernels' layout (engine/quant/), on the device
                  ─► each mixture-of-experts block stored quantized per expert: its experts
                    kept in their stored layout, gate/up joined (a StoredExperts per fused
                    tensor, engine/quant/experts.py, which the fused MoE multiplies by);
                    where they cannot be stacked (act-order, mixed layouts), dequantized into
                    the load dtype, the log saying why
                  ─► the LM head, if stored quantized: dequantized (the logits head reads a
                    plain weight)
                  ─► every other parameter and stored buffer read as engine/model/
                    shard_loading.py reads them

Under tensor parallelism (``shard``) the model is sharded on the meta device first
(``shard_model``), each projection read whole from its file on the host, one at a time, and
sliced in its stored layout (``engine/quant/slicing.py``), and every other parameter read as
its slices (``shard_reader``); a mixture-of-experts model is left to the whole-model path.

A parameter with no stored tensor, or a stored quantized tensor nothing reads (a projection the
model does not have where the checkpoint has one), is a ValueError naming it.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import fields, replace
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, PreTrainedModel

from paged_serve.engine.model.experts_swap import experts_modules
from paged_serve.engine.model.shard_loading import (
    EXPERT_PARTS,
    MODULE_RENAMES,
    OneFileAtATime,
    block_names,
    checkpoint_files,
    empty_model,
    fill_parameters,
    read_buffers,
    shard_reader,
    stored_as,
)
from paged_serve.engine.model.sharding import (
    SOURCE,
    RowParallelLinear,
    ShardSource,
    check_shardable,
    shard_model,
)
from paged_serve.engine.quant.checkpoint import (
    is_stored_quantized,
    projection_names,
    read_projection,
)
from paged_serve.engine.quant.experts import ExpertsNotStacked, StoredExperts, stack_experts
from paged_serve.engine.quant.linear import QuantizedLinear
from paged_serve.engine.quant.scheme import CheckpointQuantization
from paged_serve.engine.quant.slicing import input_columns, output_ranges
from paged_serve.engine.quant.weights import QuantizedWeight

logger = logging.getLogger(__name__)


def stored_quantization_config(folder: Path) -> dict | None:
    """``config.json``'s ``quantization_config`` as stored (a dict), or None."""
    config = json.loads((folder / "config.json").read_text())
    return config.get("quantization_config")


class CheckpointTensors:
    """The checkpoint's tensors by name, read whole onto the host (``StoredTensors``), with the
    names read so far (``read``)."""

    def __init__(self, files: dict[str, Path], checkpoint: OneFileAtATime):
        self.files = files
        self.checkpoint = checkpoint
        self.read: set[str] = set()

    def __contains__(self, name: object) -> bool:
        return name in self.files

    def get(self, name: str) -> torch.Tensor:
        self.read.add(name)
        return self.checkpoint.slice(name)[:]


def load_quantized(
    path: str,
    quant: CheckpointQuantization,
    *,
    dtype: torch.dtype,
    device: torch.device,
    shard: tuple[int, int] | None = None,
) -> PreTrainedModel | None:
    """The model in folder ``path``, its projections stored quantized kept so (module
    docstring), everything else in ``dtype``, all on ``device``. With ``shard = (rank, world
    size)``: that tensor-parallel rank's shard alone, sharded on the meta device as
    ``shard_model`` shards, each projection read and sliced in its stored layout
    (``engine/quant/slicing.py``), the rest read as its slices; None for a mixture-of-experts
    model (its stored experts are sliced once whole: the caller loads it whole)."""
    folder = Path(path)
    files = checkpoint_files(folder)
    config = AutoConfig.from_pretrained(folder)
    del config.quantization_config  # read by engine/quant/, not by transformers
    model = empty_model(folder, dtype, config=config)
    # where each parameter of the whole model is stored (sharding makes new ones, which name
    # their whole parameter in their ShardSource)
    stored = {id(p): (name, stored_as(name, files)) for name, p in model.named_parameters()}
    if shard is not None:
        if experts_modules(model):
            logger.info("tensor parallelism: loading all of %s on each rank (stored experts)", path)
            return None
        rank, world_size = shard
        check_shardable(model, world_size)
        shard_model(model, rank=rank, world_size=world_size)
    with OneFileAtATime(files) as checkpoint:
        tensors = CheckpointTensors(files, checkpoint)
        kinds = _swap_projections(model, quant, tensors, dtype, device)
        experts = _quantized_experts(model, quant, tensors, dtype, device)
        # what is still meta (the experts filled above are not: their stored names are the
        # quantized ones) must be stored
        missing = [
            name
            for name, p in model.named_parameters()
            if p.is_meta and stored.get(id(_whole_of(p)), (name, None))[1] is None
        ]
        if missing:
            raise ValueError(f"{path}: no stored tensor for {len(missing)} ({missing[0]}, ...)")

        if shard is not None:
            read = shard_reader(checkpoint)
        else:

            def read(where, source):
                del source  # unsharded
                if isinstance(where, str):
                    return tensors.get(where)
                return torch.stack([torch.cat([tensors.get(n) for n in parts]) for parts in where])

        fill_parameters(model, stored, read, dtype, device)
        read_buffers(model, files, read, device)
    _check_all_read(path, quant, files, tensors.read)
    summary = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
    logger.info("%s: %s; projections: %s", path, quant.describe(), summary or "none quantized")
    for kind, n in sorted(experts.items()):
        logger.info("%s: %d experts tensors stored quantized, %s", path, n, kind)
    return model


def _stored_prefix(name: str, tensors: CheckpointTensors, quant: CheckpointQuantization) -> str:
    """The checkpoint's name for module ``name`` (its own, or Mixtral's block name)."""
    for ours, theirs in MODULE_RENAMES:
        renamed = name.replace(ours, theirs, 1) if ours in name else None
        if renamed and any(n in tensors for n in projection_names(quant, renamed)):
            return renamed
    return name


def _swap_projections(
    model: PreTrainedModel,
    quant: CheckpointQuantization,
    tensors: CheckpointTensors,
    dtype: torch.dtype,
    device: torch.device,
) -> Counter:
    """Every ``nn.Linear`` stored quantized becomes a ``QuantizedLinear`` (the LM head: a plain
    ``nn.Linear`` of the dequantized weight); returns how many of each layout."""
    kinds: Counter = Counter()
    head = model.get_output_embeddings()
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear:
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        # a row-parallel projection's local product is its ``proj``, stored under its own name
        stored_name = parent_name if isinstance(parent, RowParallelLinear) else name
        prefix = _stored_prefix(stored_name, tensors, quant)
        weight = read_projection(quant, tensors, prefix, stored_name)
        if weight is None:
            continue
        weight = _this_ranks(weight, getattr(module.weight, SOURCE, None))
        bias = None
        if module.bias is not None:
            bias = tensors.get(f"{prefix}.bias")
            source = getattr(module.bias, SOURCE, None)
            if source is not None and source.ranges:
                bias = torch.cat([bias[a:b] for a, b in source.ranges])
            bias = bias.to(device, dtype)
        if module is head:
            head.weight = nn.Parameter(weight.dequantize().to(device, dtype), requires_grad=False)
            if bias is not None:
                head.bias = nn.Parameter(bias, requires_grad=False)
            kinds["LM head dequantized"] += 1
            continue
        on_device = _on(weight, device)
        setattr(parent, attr, QuantizedLinear(on_device, bias))
        kinds[on_device.__class__.__name__] += 1
    return kinds


def _this_ranks(weight: QuantizedWeight, source: ShardSource | None) -> QuantizedWeight:
    """``weight`` sliced as ``source`` (a meta shard's) says: output rows, or input columns."""
    if source is None or not source.ranges:
        return weight
    if source.dim == 0:
        return output_ranges(weight, source.ranges)
    ((a, b),) = source.ranges
    return input_columns(weight, a, b)


def _whole_of(param: torch.Tensor) -> torch.Tensor:
    """The whole model's parameter a meta shard was cut from (itself when not sharded)."""
    source = getattr(param, SOURCE, None)
    return param if source is None else source.full


def _on(layout, device: torch.device):
    """The layout dataclass ``layout`` with its tensors on ``device``."""
    return replace(layout, **{f.name: _to(getattr(layout, f.name), device) for f in fields(layout)})


def _quantized_experts(
    model: PreTrainedModel,
    quant: CheckpointQuantization,
    tensors: CheckpointTensors,
    dtype: torch.dtype,
    device: torch.device,
) -> Counter:
    """Each experts module whose fused tensors the checkpoint stores quantized per expert and
    part: both kept stored (``StoredExperts``, ``[E, out, in]``: the module's layout becomes
    untransposed), or, where they cannot be stacked, each filled with the dequantized values
    (``[E, out, in]``, or ``[E, in, out]`` where the module is transposed). Returns how many
    tensors went each way."""
    kinds: Counter = Counter()
    prefixes = {id(m): n for n, m in model.named_modules()}
    for module in experts_modules(model):
        name = prefixes[id(module)]
        block = name.rsplit(".experts", 1)[0]
        stored: dict[str, list[list[str]]] = {}
        for fused, layouts in EXPERT_PARTS.items():
            param = getattr(module, fused, None)
            if not isinstance(param, nn.Parameter) or not param.is_meta:
                continue
            experts = _quantized_expert_parts(block, layouts, param.shape[0], tensors, quant)
            if experts is not None:
                stored[fused] = experts
        if not stored:
            continue
        weights = {
            fused: [[_read_expert(quant, tensors, p) for p in parts] for parts in experts]
            for fused, experts in stored.items()
        }
        try:
            if set(stored) != set(EXPERT_PARTS) or not module.has_gate:
                raise ExpertsNotStacked("only some of its experts tensors are stored quantized")
            stacked = {fused: stack_experts(parts) for fused, parts in weights.items()}
        except ExpertsNotStacked as why:
            logger.info("%s: experts dequantized to %s at load: %s", name, dtype, why)
            for fused, parts in weights.items():
                _fill_dequantized(module, fused, parts, dtype, device)
                kinds[f"dequantized to {dtype}"] += 1
            continue
        for fused, experts in stacked.items():
            on_device = _on(experts, device)
            delattr(module, fused)
            setattr(module, fused, StoredExperts(on_device))
            kinds[f"kept as {type(experts).__name__}"] += 1
        module.is_transposed = False
    return kinds


def _to(value: object, device: torch.device) -> object:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _fill_dequantized(
    module: nn.Module,
    fused: str,
    experts: list[list[QuantizedWeight]],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Set ``module.fused`` to the dequantized experts, in the module's layout."""
    values = torch.stack(
        [torch.cat([w.dequantize().to(dtype) for w in parts]) for parts in experts]
    )
    if module.is_transposed:
        values = values.transpose(1, 2)
    setattr(module, fused, nn.Parameter(values.contiguous().to(device), requires_grad=False))


def _quantized_expert_parts(
    block: str,
    layouts: tuple[tuple[str, ...], ...],
    num_experts: int,
    tensors: CheckpointTensors,
    quant: CheckpointQuantization,
) -> list[list[str]] | None:
    """Per expert, the stored prefixes of its parts (``experts.{e}.gate_proj``, ...), when the
    checkpoint stores every one of them quantized; None otherwise."""
    for prefix in block_names(block):
        for parts in layouts:
            names = [[f"{prefix}.experts.{e}.{p}" for p in parts] for e in range(num_experts)]
            if all(is_stored_quantized(quant, tensors, n) for expert in names for n in expert):
                return names
    return None


def _read_expert(
    quant: CheckpointQuantization, tensors: CheckpointTensors, prefix: str
) -> QuantizedWeight:
    weight = read_projection(quant, tensors, prefix, prefix)
    if weight is None:
        raise ValueError(f"{prefix}: expected a quantized expert projection")
    return weight


def _check_all_read(
    path: str, quant: CheckpointQuantization, files: dict[str, Path], read: set[str]
) -> None:
    """Refuse a checkpoint holding quantized tensors that no module read."""
    suffixes = {
        n.rsplit(".", 1)[1] for n in projection_names(quant, "p") if not n.endswith(".weight")
    }
    unread = sorted(n for n in files if n not in read and n.rsplit(".", 1)[-1] in suffixes)
    if unread:
        raise ValueError(
            f"{path}: {len(unread)} quantized tensors belong to no projection of the model "
            f"({unread[0]}, ...)"
        )
