"""Load one tensor-parallel rank's shard straight from a safetensors folder, never the whole model.

    config.json ──► the model built on the meta device (parameters without storage; buffers
                    such as rotary frequencies computed as usual)
                ──► shard_model on it: every sharded parameter carries a ShardSource
                    (which full tensor, which ranges along which dim)
    *.safetensors ─► for each parameter: safe_open(...).get_slice(name)[ranges], cast to the
                    load dtype, moved to the rank's device, put in place of the meta one
                    (tied parameters stay tied)

safetensors maps the file and ``get_slice`` copies out only the bytes asked for, and each tensor
goes to the rank's device as soon as it is read: a rank's host memory holds its shard plus the
one tensor it is reading on the CPU, only that tensor when the rank's device is a GPU (a
row-parallel weight's column slice touches every row of the mapped tensor, whose pages the
kernel may drop again).

A tensor is found under the model's own name, under the name of a checkpoint that calls the
block otherwise (Mixtral's ``block_sparse_moe`` for ``mlp``), or, for the fused experts
tensors transformers builds at load (``experts.gate_up_proj [E, 2I, H]``, gate rows then up
rows, and ``experts.down_proj [E, H, I]``), as one tensor per expert and part
(``experts.{e}.gate_proj/up_proj/down_proj.weight``, Mixtral's ``w1/w3/w2``): each expert's
rows of this rank are read from its parts and stacked.

gpt-oss's MXFP4 experts (``experts.gate_up_proj_blocks`` / ``_scales``: e2m1 values in groups
of 32 along the input dim, low nibble first, each group sharing a power-of-two scale, stored
``[E, out, in / 32, 16]``) are read as the rank's rows of the output dim or its groups of the
input dim, dequantised into the load dtype and transposed to the model's ``[E, in, out]``: the
values transformers' own dequantisation gives, for the rank's slice only.

Checkpoints stored quantized (GPTQ, AWQ, compressed-tensors, FP8) are read per rank by
engine/model/quantized_loading.py with ``shard_reader`` for their unquantized tensors.
Whole-model loading (``from_pretrained``) remains for what this cannot read: checkpoints stored
under other names still, other quantized checkpoints, and hub ids (not on disk); GGUF files are
read through their safetensors conversion. ``load_shard`` returns None for those,
with the reason in the log.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import init_empty_weights
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
)

from paged_serve.engine.model.sharding import SOURCE, ShardSource, check_shardable, shard_model
from paged_serve.engine.model.stored_quantization import stored_quantization

logger = logging.getLogger(__name__)

CPU = torch.device("cpu")

INDEX_FILE = "model.safetensors.index.json"
# (the model's module name, a checkpoint's name for it)
MODULE_RENAMES = ((".mlp.", ".block_sparse_moe."),)
# a fused experts tensor -> the per-expert parts it concatenates, by the checkpoints' names
EXPERT_PARTS = {
    "gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")),
    "down_proj": (("down_proj",), ("w2",)),
}
FUSED_EXPERTS = re.compile(r"(?P<block>.*)\.experts\.(?P<fused>gate_up_proj|down_proj)")

MXFP4_GROUP = 32  # input features sharing one scale
# e2m1: the 16 values a nibble encodes (sign bit 3)
FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_VALUES = FP4_MAGNITUDES + tuple(-v for v in FP4_MAGNITUDES)


@dataclass(frozen=True, slots=True)
class Mxfp4Stored:
    """A fused experts tensor ``[E, in, out]`` stored as MXFP4 ``blocks`` and ``scales``."""

    blocks: str
    scales: str


# Where a model tensor is stored: one checkpoint name, per expert the names of its parts, or
# MXFP4 blocks and scales
Stored = str | list[list[str]] | Mxfp4Stored


def checkpoint_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it: from the index of a sharded checkpoint
    (every file it lists must be in ``folder``), else every ``*.safetensors`` file in ``folder``.
    An index or a header that cannot be read is a ValueError naming the file."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {name: folder / file for name, file in weight_map.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{index}: not a safetensors index ({exc})") from None
        listed = {path: name for name, path in files.items()}  # one name each file holds
        for path, name in listed.items():
            if not path.is_file():
                missing = f"{path.name}, which is not in the folder"
                raise ValueError(f"{index}: lists {name} in {missing}")
        return files
    names: dict[str, Path] = {}
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(file, framework="pt") as f:
                names.update(dict.fromkeys(f.keys(), file))
        except SafetensorError as exc:
            raise ValueError(f"{file}: not a readable safetensors file ({exc})") from None
    return names


def block_names(block: str) -> list[str]:
    """A block's module name and the names checkpoints may store it under (``MODULE_RENAMES``:
    Mixtral's ``block_sparse_moe`` for ``mlp``)."""
    return [block] + [
        (block + ".").replace(ours, theirs, 1)[:-1]
        for ours, theirs in MODULE_RENAMES
        if ours in block + "."
    ]


def stored_as(name: str, files: Mapping[str, object]) -> Stored | None:
    """Where the checkpoint holds model tensor ``name`` (module docstring), or None."""
    if name in files:
        return name
    renamed = [name.replace(ours, theirs, 1) for ours, theirs in MODULE_RENAMES if ours in name]
    for alt in renamed:
        if alt in files:
            return alt
    match = FUSED_EXPERTS.fullmatch(name)
    if match is None:
        return None
    if f"{name}_blocks" in files and f"{name}_scales" in files:
        return Mxfp4Stored(f"{name}_blocks", f"{name}_scales")
    for prefix in block_names(match["block"]):
        for parts in EXPERT_PARTS[match["fused"]]:
            experts: list[list[str]] = []
            while all(f"{prefix}.experts.{len(experts)}.{p}.weight" in files for p in parts):
                experts.append([f"{prefix}.experts.{len(experts)}.{p}.weight" for p in parts])
            if experts:
                return experts
    return None


def empty_model(
    path: Path, dtype: torch.dtype, config: PretrainedConfig | None = None
) -> PreTrainedModel:
    """The model of ``config`` (default: ``path``'s) with parameters on the meta device, buffers
    real."""
    config = config if config is not None else AutoConfig.from_pretrained(path)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # a tied head shares the embedding (from_pretrained ties at load)
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval()


def load_shard(
    path: str,
    *,
    rank: int,
    world_size: int,
    dtype: torch.dtype,
    device: torch.device = CPU,
) -> PreTrainedModel | None:
    """Rank ``rank``'s shard of the model in folder ``path`` (of ``world_size``), in ``dtype``,
    its parameters and stored buffers on ``device`` (each tensor moved there as it is read, so
    on a GPU the host holds one tensor at a time, never the shard), sharded as ``shard_model``
    shards; None when the folder cannot be read name for name (module docstring), and the
    caller loads the whole model instead. Raises ValueError (from ``check_shardable``) when the
    model does not shard ``world_size`` ways."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        return _whole(path, "not a local folder")
    if stored_quantization(AutoConfig.from_pretrained(folder)) not in (None, "mxfp4"):
        return _whole(path, "a quantized checkpoint other than MXFP4")
    files = checkpoint_files(folder)
    model = empty_model(folder, dtype)
    stored = {id(p): (name, stored_as(name, files)) for name, p in model.named_parameters()}
    missing = [name for name, where in stored.values() if where is None]
    if missing:
        stored_elsewhere = f"{len(missing)} parameters stored under other names ({missing[0]})"
        return _whole(path, stored_elsewhere)
    check_shardable(model, world_size)
    shard_model(model, rank=rank, world_size=world_size)
    with OneFileAtATime(files) as checkpoint:
        read = shard_reader(checkpoint)
        fill_parameters(model, stored, read, dtype, device)
        read_buffers(model, files, read, device)
    return model


def shard_reader(checkpoint: OneFileAtATime):
    """``read(where, source)``: the stored tensor ``where`` (a name, per-expert parts or MXFP4
    blocks), only the ranges of ``source`` along its dim (all of it without a source)."""

    def read(where: Stored, source: ShardSource | None) -> torch.Tensor:
        ranges = () if source is None else source.ranges
        if isinstance(where, Mxfp4Stored):
            return _mxfp4_slices(checkpoint, where, source)
        if isinstance(where, str):
            return _slices([checkpoint.slice(where)], source.dim if ranges else 0, ranges)
        # per expert: its parts are 2-D, the fused tensor's dim d is their dim d - 1
        dim = source.dim - 1 if ranges else 0
        parts = [[checkpoint.slice(name) for name in expert] for expert in where]
        return torch.stack([_slices(expert, dim, ranges) for expert in parts])

    return read


class OneFileAtATime:
    """A checkpoint's tensors, each read lazily (``slice(name)``: safetensors' slice object)
    from its file, with one file open at a time: opening the next closes the last, dropping
    its mapping and the pages read through it."""

    def __init__(self, files: dict[str, Path]):
        self.files = files
        self._open: tuple[Path, ExitStack, object] | None = None

    def slice(self, name: str) -> object:
        file = self.files[name]
        if self._open is None or self._open[0] != file:
            self.close()
            scope = ExitStack()
            self._open = (file, scope, scope.enter_context(safe_open(file, framework="pt")))
        return self._open[2].get_slice(name)

    def close(self) -> None:
        if self._open is not None:
            self._open[1].close()
            self._open = None

    def __enter__(self) -> OneFileAtATime:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _slices(parts: list, dim: int, ranges: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """``ranges`` along ``dim`` of the concatenation of ``parts`` (safetensors slices of equal
    width along ``dim``), read without materialising the rest; all of it without ranges."""
    if not ranges:
        pieces = [part[:] for part in parts]
    else:
        width = parts[0].get_shape()[dim]
        lead = (slice(None),) * dim
        pieces = []
        for start, stop in ranges:
            k = start // width  # a range never crosses parts (shards split each part)
            local = slice(start - k * width, stop - k * width)
            pieces.append(parts[k][(*lead, local)])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def _mxfp4_slices(
    checkpoint: OneFileAtATime, where: Mxfp4Stored, source: ShardSource | None
) -> torch.Tensor:
    """The model's ``[E, in, out]`` tensor (the ranges of ``source`` along its dim) from MXFP4
    blocks and scales stored ``[E, out, in / 32, (16)]``: the model's out dim is the stored dim
    1, its in dim the stored groups (dim 2), so a range of inputs must start and end on a group
    boundary."""
    blocks, scales = checkpoint.slice(where.blocks), checkpoint.slice(where.scales)
    if source is None or not source.ranges:
        return dequantize_mxfp4(blocks[:], scales[:]).transpose(1, 2)
    if source.dim == 2:  # output rows
        dim, ranges = 1, source.ranges
    else:  # input features, in groups
        bad = [r for r in source.ranges if r[0] % MXFP4_GROUP or r[1] % MXFP4_GROUP]
        if bad:
            raise ValueError(
                f"{where.blocks}: a shard's input range {bad[0]} cuts an MXFP4 group of "
                f"{MXFP4_GROUP}"
            )
        dim, ranges = 2, tuple((a // MXFP4_GROUP, b // MXFP4_GROUP) for a, b in source.ranges)
    return dequantize_mxfp4(
        _slices([blocks], dim, ranges), _slices([scales], dim, ranges)
    ).transpose(1, 2)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``[E, out, in]`` fp32 values of MXFP4 ``blocks [E, out, G, 16]`` uint8 (two e2m1 values a
    byte, low nibble first) and ``scales [E, out, G]`` uint8 (exponent + 127) of ``G`` groups."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    nibbles = torch.stack([blocks & 15, blocks >> 4], dim=-1).flatten(-2).long()  # [.., G, 32]
    values = lut[nibbles] * torch.exp2(scales.to(torch.float32) - 127)[..., None]
    return values.flatten(-2)


def read_buffers(model: nn.Module, files: dict[str, Path], read, device: torch.device) -> None:
    """Persistent buffers the checkpoint stores (a router's score-correction bias, say) take
    the stored values, in the buffer's own dtype, on ``device``; the rest keep what the config
    computed (on the CPU: moving the model to its device moves them)."""
    for prefix, module in model.named_modules():
        for key, buffer in list(module._buffers.items()):
            name = f"{prefix}.{key}" if prefix else key
            if buffer is None or key in module._non_persistent_buffers_set:
                continue
            where = stored_as(name, files)
            if isinstance(where, str):
                module._buffers[key] = read(where, None).to(device, buffer.dtype)


def _whole(path: str, why: str) -> None:
    logger.info("tensor parallelism: loading all of %s on each rank (%s)", path, why)
    return None


def fill_parameters(
    model: nn.Module,
    stored: dict[int, tuple[str, Stored]],
    read,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Replace every meta parameter with its values on ``device``: a sharded one's slices (its
    ShardSource), zeros where the source says so, an untouched one read whole. A parameter held
    by several modules (a tied LM head) is read once and stays shared."""
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if id(param) not in done:
                source: ShardSource | None = getattr(param, SOURCE, None)
                if source is not None and source.zeros:
                    values = torch.zeros(param.shape, dtype=dtype, device=device)
                else:
                    entry = stored.get(id(source.full if source is not None else param))
                    if entry is None:
                        raise RuntimeError(f"sharding left {key} with no checkpoint tensor")
                    values = read(entry[1], source)
                    values = values.to(device, dtype if values.is_floating_point() else None)
                if values.shape != param.shape:
                    raise ValueError(
                        f"checkpoint tensor for {key} has shape {tuple(values.shape)}, "
                        f"the shard needs {tuple(param.shape)}"
                    )
                done[id(param)] = nn.Parameter(values.contiguous(), requires_grad=False)
            module._parameters[key] = done[id(param)]
