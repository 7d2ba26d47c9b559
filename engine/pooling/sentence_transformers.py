"""A sentence-transformers folder, read the way sentence-transformers reads it.

An embedding model ships its pipeline beside the transformer's own files::

    modules.json                          the modules in order: Transformer, Pooling, Dense...,
                                          Normalize
    sentence_bert_config.json             max_seq_length (inputs longer are cut by ST; here
                                          the served context length)
    1_Pooling/config.json                 the pooling mode: ``pooling_mode`` ("mean"), or the
                                          older flags (``pooling_mode_mean_tokens``: true, ...)
    2_Dense/config.json, model.safetensors  a Linear (``linear.weight``, ``linear.bias``) and
                                          its activation
    config_sentence_transformers.json     prompts by name (Qwen3-Embedding's "query"
                                          instruction) and the default one

What this engine does not run (the ``weightedmean`` and ``mean_sqrt_len`` poolings, a pooling
that leaves the prompt out, LayerNorm, word-embedding or CNN modules) is a ValueError naming
it, never skipped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from safetensors.torch import load_file
from torch import nn

POOLING_MODES = ("cls", "mean", "last", "max")
# the names sentence-transformers writes for each mode, old flag style and new
_MODE_NAMES = {
    "cls": "cls",
    "cls_token": "cls",
    "mean": "mean",
    "mean_tokens": "mean",
    "lasttoken": "last",
    "last": "last",
    "max": "max",
    "max_tokens": "max",
}
_ACTIVATIONS = {
    "Identity": nn.Identity,
    "Tanh": nn.Tanh,
    "ReLU": nn.ReLU,
    "GELU": nn.GELU,
    "Sigmoid": nn.Sigmoid,
    "SiLU": nn.SiLU,
}


@dataclass(frozen=True, slots=True)
class SentenceTransformersConfig:
    """What a sentence-transformers folder asks for. ``pooling`` is one of ``POOLING_MODES``;
    ``dense`` the Dense modules in order (Linear then activation); ``prompts`` by name."""

    pooling: str | None = None
    normalize: bool = False
    dense: tuple[nn.Module, ...] = ()
    max_seq_length: int | None = None
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(value, (dict, list)):
        raise ValueError(f"{path}: not a JSON object")
    return value


def pooling_mode(config: dict, where: Path) -> str:
    """The one pooling mode of a ``1_Pooling/config.json`` (either naming style)."""
    if "pooling_mode" in config:
        modes = [config["pooling_mode"]]
    else:
        flags = [k for k, v in config.items() if k.startswith("pooling_mode_") and v is True]
        modes = [k.removeprefix("pooling_mode_") for k in flags]
    if len(modes) != 1 or modes[0] not in _MODE_NAMES:
        raise ValueError(
            f"{where}: pooling {modes or 'none'} is not served (one of cls, mean, lasttoken, max)"
        )
    if config.get("include_prompt", True) is False:
        raise ValueError(f"{where}: a pooling that leaves the prompt out is not served")
    return _MODE_NAMES[modes[0]]


def dense_module(folder: Path) -> nn.Module:
    """A sentence-transformers Dense folder as ``Linear`` then its activation (float32)."""
    config = _json(folder / "config.json")
    activation = str(config.get("activation_function", "Identity")).rsplit(".", 1)[-1]
    if activation not in _ACTIVATIONS:
        raise ValueError(f"{folder}: the Dense activation {activation} is not served")
    linear = nn.Linear(
        int(config["in_features"]), int(config["out_features"]), bias=bool(config.get("bias"))
    )
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise ValueError(f"{folder}: no model.safetensors (a Dense layer's weights)")
    state = {k.removeprefix("linear."): v for k, v in load_file(str(weights)).items()}
    linear.load_state_dict(state)
    return nn.Sequential(linear, _ACTIVATIONS[activation]())


def read_sentence_transformers(folder: str | Path) -> SentenceTransformersConfig | None:
    """The pipeline of the sentence-transformers folder ``folder``; None when it is not one."""
    root = Path(folder)
    modules_path = root / "modules.json"
    if not modules_path.is_file():
        return None
    pooling, normalize, dense = None, False, []
    for module in _json(modules_path):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        path = root / str(module.get("path", ""))
        if kind == "Transformer":
            continue
        if kind == "Pooling":
            pooling = pooling_mode(_json(path / "config.json"), path / "config.json")
        elif kind == "Dense":
            dense.append(dense_module(path))
        elif kind == "Normalize":
            normalize = True
        else:
            raise ValueError(f"{modules_path}: the {kind} module is not served")
    bert_config = root / "sentence_bert_config.json"
    max_len = _json(bert_config).get("max_seq_length") if bert_config.is_file() else None
    st_config = root / "config_sentence_transformers.json"
    extra = _json(st_config) if st_config.is_file() else {}
    return SentenceTransformersConfig(
        pooling=pooling,
        normalize=normalize,
        dense=tuple(dense),
        max_seq_length=int(max_len) if max_len else None,
        prompts={str(k): str(v) for k, v in (extra.get("prompts") or {}).items()},
        default_prompt_name=extra.get("default_prompt_name"),
    )
