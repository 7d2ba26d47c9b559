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

A parameter with no stored tensor, or a stored quantized tensor nothing reads (a projection the
model does not have where the checkpoint has one), is a ValueError naming it.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, PreTrainedModel

from paged_serve.engine.model.experts_swap import experts_modules
from paged_serve.engine.model.shard_loading import (
    EXPERT_PARTS,
    MODULE_RENAMES,
    OneFileAtATime,
    checkpoint_files,
    empty_model,
    fill_parameters,
    read_buffers,
    stored_as,
)
from paged_serve.engine.quant.checkpoint import (
    is_stored_quantized,
    projection_names,
    read_projection,
)
from paged_serve.engine.quant.experts import ExpertsNotStacked, StoredExperts, stack_experts
from paged_serve.engine.quant.linear import QuantizedLinear
from paged_serve.engine.quant.scheme import CheckpointQuantization
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
    path: str, quant: CheckpointQuantization, *, dtype: torch.dtype, device: torch.device
) -> PreTrainedModel:
    """The model in folder ``path``, its projections stored quantized kept so (module
    docstring), everything else in ``dtype``, all on ``device``."""
    folder = Path(path)
    files = checkpoint_files(folder)
    config = AutoConfig.from_pretrained(folder)
    del config.quantization_config  # read by engine/quant/, not by transformers
    model = empty_model(folder, dtype, config=config)
    with OneFileAtATime(files) as checkpoint:
        tensors = CheckpointTensors(files, checkpoint)
        kinds = _swap_projections(model, quant, tensors, dtype, device)
        experts = _quantized_experts(model, quant, tensors, dtype, device)
        # the experts filled above are no longer meta: their stored names are the quantized ones
        stored = {
            id(p): (name, stored_as(name, files))
            for name, p in model.named_parameters()
            if p.is_meta
        }
        missing = [name for name, where in stored.values() if where is None]
        if missing:
            raise ValueError(f"{path}: no stored tensor for {len(missing)} ({missing[0]}, ...)")

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
        prefix = _stored_prefix(name, tensors, quant)
        weight = read_projection(quant, tensors, prefix, name)
        if weight is None:
            continue
        bias = tensors.get(f"{prefix}.bias").to(device, dtype) if module.bias is not None else None
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        if module is head:
            head.weight = nn.Parameter(weight.dequantize().to(device, dtype), requires_grad=False)
            if bias is not None:
                head.bias = nn.Parameter(bias, requires_grad=False)
            kinds["LM head dequantized"] += 1
            continue
        on_device = type(weight)(
            **{
                f: (v.to(device) if isinstance(v, torch.Tensor) else v)
                for f, v in _fields(weight).items()
            }
        )
        setattr(parent, attr, QuantizedLinear(on_device, bias))
        kinds[on_device.__class__.__name__] += 1
    return kinds


def _fields(weight) -> dict:
    return {name: getattr(weight, name) for name in weight.__dataclass_fields__}


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
            on_device = type(experts)(**{f: _to(v, device) for f, v in _fields(experts).items()})
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
    blocks = [block] + [
        (block + ".").replace(ours, theirs, 1)[:-1]
        for ours, theirs in MODULE_RENAMES
        if ours in block + "."
    ]
    for prefix in blocks:
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
