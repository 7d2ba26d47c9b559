"""Refuse a checkpoint that does not match its ``config.json``, before any weight is allocated.

``from_pretrained`` builds the model its config describes, fills what the files hold and
initialises the rest at random: a folder missing its LM head would load and answer garbage,
and a config asking for 10^9 vocabulary rows or 10^6 layers allocates (or builds modules) for
minutes before anything fails. So a local safetensors checkpoint is checked first, reading
nothing but headers::

    config.json ──► sizes: positive integers, heads that divide      (no model built yet)
    *.safetensors headers (names, shapes; the index's names when there is one)
                ──► layers: config's num_hidden_layers <= the layers the files hold
    config.json ──► the model on the meta device (no storage)
                ──► every parameter's tensor found (``stored_as``: its own name, Mixtral's,
                    per-expert parts, MXFP4 blocks/scales) with the shape the model needs;
                    every stored tensor used by the model

A parameter counts as missing here only when no stored tensor is left over that transformers
could rename into it (its conversion mapping renames legacy names at load); otherwise the
verdict waits for ``check_loading_info``, which reads transformers' own load report after
``from_pretrained`` and refuses missing, unexpected and mismatched tensors too. Tied heads
(``tie_word_embeddings``) and buffers the model computes (rotary ``inv_freq``) are not missing;
stored tensors transformers ignores (its ``_keys_to_ignore_on_load_unexpected``, old per-layer
``inv_freq``) are not unexpected. Quantized checkpoints other than MXFP4 store other names
(``qweight``, scales), so only their config and layer count are checked up front.

Every refusal is a ValueError of one line naming the folder, which the CLI prints as its
start error.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from paged_serve.engine.model.shard_loading import (
    INDEX_FILE,
    MXFP4_GROUP,
    Mxfp4Stored,
    Stored,
    checkpoint_files,
    stored_as,
)
from paged_serve.engine.model.stored_quantization import stored_quantization

# config fields that size the model: each must be a positive integer where the config has it
SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)
# the layer index in a stored tensor's name (``model.layers.3.``, GPT-2's ``h.3.``)
LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")
# stored tensors transformers drops at load in every model (modeling_utils,
# ``_adjust_missing_and_unexpected_keys``): old per-layer rotary frequencies and position ids
ALWAYS_IGNORED = (r"rotary_emb\.inv_freq", r"(^|\.)position_ids$")
NAMES_SHOWN = 4  # names quoted in a refusal; the rest are counted

Shape = tuple[int, ...]


def check_config_sizes(config: Mapping[str, object], where: str) -> None:
    """Raise ValueError naming the field when a size in ``config`` (``config.json`` as read,
    and its ``text_config`` for a multimodal model) is not a positive integer, or its heads do
    not divide: the model built from it would divide by zero (transformers' config classes
    already do), allocate nonsense or fail mid-forward."""
    for part in (config, config.get("text_config")):
        if isinstance(part, Mapping):
            _check_sizes(part, where)


def _check_sizes(config: Mapping[str, object], where: str) -> None:
    for name in SIZE_FIELDS:
        value = config.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: {name} is {value!r}; it must be a positive integer")
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise ValueError(
            f"{where}: num_attention_heads {heads} is not a multiple of "
            f"num_key_value_heads {kv_heads}"
        )
    hidden = config.get("hidden_size")
    if config.get("head_dim") is None and heads is not None and hidden is not None:
        if hidden % heads:
            raise ValueError(
                f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads "
                f"{heads} (and head_dim is not given)"
            )


def stored_shapes(folder: Path) -> dict[str, Shape] | None:
    """Stored tensor name -> shape, read from the safetensors headers alone (the names an index
    lists, when the folder has ``model.safetensors.index.json``; ``checkpoint_files``); None
    when the folder holds no safetensors file. A header that cannot be read, or that lacks a
    tensor the index lists, is a ValueError naming the file."""
    files = checkpoint_files(folder)
    if not files and not (folder / INDEX_FILE).is_file():
        return None
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    shapes: dict[str, Shape] = {}
    for path, names in by_file.items():
        try:
            with safe_open(path, framework="pt") as f:
                keys = set(f.keys())
                for name in names:
                    if name not in keys:
                        raise ValueError(f"{path}: the index lists {name}, the file lacks it")
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except SafetensorError as exc:
            raise ValueError(f"{path}: not a readable safetensors file ({exc})") from None
    return shapes


def check_checkpoint(
    folder: Path, auto_class: type = AutoModelForCausalLM, **options: object
) -> None:
    """Refuse the local checkpoint ``folder`` when its config is nonsensical or its safetensors
    headers do not hold the tensors, and the shapes, the config implies (module docstring), as
    ``auto_class`` builds the model (with ``options``, ``load_options``'s); nothing is
    allocated. A folder without safetensors files
    (``.bin`` weights) has only its config checked here; ``check_loading_info`` covers it after
    the load."""
    where = str(folder / "config.json")
    try:
        raw = json.loads(Path(where).read_text())
    except ValueError as exc:
        raise ValueError(f"{where}: not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: not a JSON object")
    check_config_sizes(raw, where)
    try:
        config = AutoConfig.from_pretrained(folder)
    except (ArithmeticError, TypeError) as exc:  # a value its config class cannot take
        raise ValueError(f"{where}: {type(exc).__name__}: {exc}") from None
    shapes = stored_shapes(folder)
    if shapes is None:
        return
    _check_layer_count(config, shapes, where)
    if stored_quantization(config) not in (None, "mxfp4"):
        return  # stored under the quantization's own names and shapes
    try:
        model = meta_model(config, auto_class, **options)
    except (ArithmeticError, ValueError, TypeError, RuntimeError) as exc:
        raise ValueError(f"{where}: no model can be built from it ({exc})") from None
    missing, unexpected, mismatched = _compare(model, shapes)
    if mismatched or (missing and not unexpected) or (unexpected and not missing):
        raise ValueError(_refusal(str(folder), missing, unexpected, mismatched))
    # missing and unexpected together: transformers may rename the one into the other at
    # load; check_loading_info decides


def load_options(folder: Path, auto_class: type) -> dict[str, object]:
    """What the model is built with beyond its config: a bare BERT-style encoder whose
    checkpoint stores no pooler (sentence-transformers saves none; embeddings never run it) is
    built without one (``add_pooling_layer=False``), so no tensor is missing."""
    if auto_class is AutoModelForCausalLM or not (folder / "config.json").is_file():
        return {}
    shapes = stored_shapes(folder)
    if shapes is None or any(name.split(".")[-3:-2] == ["pooler"] for name in shapes):
        return {}
    config = AutoConfig.from_pretrained(folder)
    model_class = auto_class._model_mapping.get(type(config), None)
    if model_class is None or "add_pooling_layer" not in inspect.signature(model_class).parameters:
        return {}
    return {"add_pooling_layer": False}


def meta_model(
    config: PretrainedConfig, auto_class: type = AutoModelForCausalLM, **options: object
) -> PreTrainedModel:
    """The model of ``config`` with every parameter and buffer on the meta device: created
    there (``torch.device`` as a context), not created on the host and moved, as
    accelerate's ``init_empty_weights`` does, which would ask the allocator for a config's
    absurd sizes first."""
    with torch.device("meta"):
        model = auto_class.from_config(config, dtype=torch.float32, **options)
    model.tie_weights()  # a tied head shares the embedding (from_pretrained ties at load)
    return model


def check_loading_info(path: str, info: dict[str, Iterable[str]]) -> None:
    """Refuse a model ``from_pretrained`` loaded (``output_loading_info=True``'s ``info``)
    with tensors missing from its checkpoint (initialised at random), stored tensors it did
    not use, or tensors of the wrong shape: one line naming them."""
    missing = sorted(info.get("missing_keys", ()))
    unexpected = sorted(info.get("unexpected_keys", ()))
    mismatched = [
        f"{entry[0]} {_shape(entry[1])} (needs {_shape(entry[2])})"
        if isinstance(entry, tuple) and len(entry) == 3
        else str(entry)
        for entry in sorted(info.get("mismatched_keys", ()), key=str)
    ]
    if missing or unexpected or mismatched:
        raise ValueError(_refusal(path, missing, unexpected, mismatched))


def _check_layer_count(config: PretrainedConfig, shapes: dict[str, Shape], where: str) -> None:
    """Refuse a config with more layers than the files hold, before its modules are built (a
    million layers take minutes and gigabytes even on the meta device)."""
    layers = getattr(config.get_text_config(), "num_hidden_layers", None)
    held = {int(m[1]) for name in shapes if (m := LAYER_INDEX.search(name))}
    if layers is not None and held and layers > len(held):
        raise ValueError(
            f"{where}: num_hidden_layers is {layers}, but the checkpoint holds {len(held)} layers"
        )


def _compare(
    model: PreTrainedModel, shapes: dict[str, Shape]
) -> tuple[list[str], list[str], list[str]]:
    """(parameters with no stored tensor, stored tensors the model does not use, tensors
    stored with a shape the model does not take) of the meta ``model`` against ``shapes``."""
    used: set[str] = set()
    missing: list[str] = []
    mismatched: list[str] = []
    ignore_missing = _regex(getattr(model, "_keys_to_ignore_on_load_missing", None) or ())
    tensors = list(model.named_parameters()) + [
        (name, buffer) for name, buffer in model.named_buffers() if _persistent(model, name)
    ]
    for name, tensor in tensors:
        where = stored_as(name, shapes)
        if where is None:
            is_param = isinstance(tensor, torch.nn.Parameter)
            if is_param and not (ignore_missing and ignore_missing.search(name)):
                missing.append(name)
            continue
        used.update(_names(where))
        stored = _model_shape(where, shapes)
        if stored is not None and stored != tuple(tensor.shape):
            mismatched.append(f"{name} {_shape(stored)} (needs {_shape(tuple(tensor.shape))})")
    used.update(model.state_dict().keys())  # tied aliases (a stored lm_head of a tied model)
    ignore = _regex(
        tuple(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()) + ALWAYS_IGNORED
    )
    unexpected = sorted(n for n in shapes if n not in used and not ignore.search(n))
    return missing, unexpected, mismatched


def _persistent(model: torch.nn.Module, name: str) -> bool:
    prefix, _, key = name.rpartition(".")
    module = model.get_submodule(prefix) if prefix else model
    return key not in module._non_persistent_buffers_set


def _names(where: Stored) -> list[str]:
    if isinstance(where, str):
        return [where]
    if isinstance(where, Mxfp4Stored):
        return [where.blocks, where.scales]
    return [name for expert in where for name in expert]


def _model_shape(where: Stored, shapes: dict[str, Shape]) -> Shape | None:
    """The shape the stored tensor(s) give the model's tensor (as shard_loading reads them),
    or None when the parts do not stack (their own shapes disagree)."""
    if isinstance(where, str):
        return shapes[where]
    if isinstance(where, Mxfp4Stored):  # blocks [E, out, in / 32, 16] -> [E, in, out]
        blocks = shapes[where.blocks]
        if len(blocks) != 4:
            return blocks
        return (blocks[0], blocks[2] * MXFP4_GROUP, blocks[1])
    # per expert: its parts concatenated along dim 0, the experts stacked
    parts = [[shapes[name] for name in expert] for expert in where]
    first = parts[0]
    if any(expert != first for expert in parts) or any(len(s) != 2 for s in first):
        return None
    if any(s[1] != first[0][1] for s in first):
        return None
    return (len(parts), sum(s[0] for s in first), first[0][1])


def _regex(patterns: Iterable[str]) -> re.Pattern[str] | None:
    patterns = list(patterns)
    if not patterns:
        return None
    return re.compile("|".join(f"({p})" for p in patterns))


def _shape(shape: object) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]" if isinstance(shape, tuple) else str(shape)


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:NAMES_SHOWN])
    more = len(names) - NAMES_SHOWN
    return f"{shown} and {more} more" if more > 0 else shown


def _refusal(where: str, missing: list[str], unexpected: list[str], mismatched: list[str]) -> str:
    parts = []
    if missing:
        parts.append(f"{_count(missing)} missing ({_listed(missing)})")
    if unexpected:
        parts.append(f"{_count(unexpected)} not in the model ({_listed(unexpected)})")
    if mismatched:
        parts.append(f"{_count(mismatched)} of the wrong shape ({_listed(mismatched)})")
    return f"{where}: the checkpoint does not match its config.json: " + "; ".join(parts)


def _count(names: list[str]) -> str:
    return f"{len(names)} tensor" + ("s" if len(names) != 1 else "")
