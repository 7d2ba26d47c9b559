"""peft's LoRA adapter files, read and checked against the served model.

An adapter folder holds ``adapter_config.json`` and ``adapter_model.safetensors``; each adapted
projection ``P`` (a module path of the base model, such as ``model.layers.3.self_attn.q_proj``)
has ``base_model.model.P.lora_A.weight [r, in]`` and ``...lora_B.weight [out, r]``, and peft's
forward adds ``scaling * B (A x)`` to the projection's output, ``scaling = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``).

Served: plain LoRA on the decoder layers' projections, any rank up to ``--max-lora-rank``.
Refused, naming why: other peft methods, DoRA, LoRA biases, ``modules_to_save`` (whole modules
replaced, such as a retrained LM head), per-module rank or alpha patterns, Conv1D layouts
(``fan_in_fan_out``), LoRA on embeddings, the LM head or a mixture of experts' experts, and
matrices whose shapes are not the served model's projections (an adapter of another base).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<path>.+)\.lora_(?P<side>[AB])(?:\.[^.]+)?\.weight$"
)


class AdapterError(ValueError):
    """An adapter that cannot be served; the message says why."""


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    """What the engine uses of ``adapter_config.json``: the rank, the scaling of ``B A``."""

    rank: int
    scaling: float
    base_model_name: str | None


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    """A served adapter. ``id``: unique for the process's lifetime (a name unloaded and loaded
    again is another adapter), what slots and caches key by; ``path``: its folder."""

    id: int
    name: str
    path: str
    rank: int
    base_model_name: str | None = None


@dataclass(frozen=True, slots=True)
class TargetShape:
    """A projection an adapter may adapt, by its module path: its full (unsharded) input and
    output features."""

    in_features: int
    out_features: int


# module names by what adapting them would mean, for the refusals' messages
_WHOLE_MODULES = ("embed_tokens", "lm_head", "wte", "embed_out", "embeddings")


def read_config(path: str | Path, max_rank: int) -> AdapterConfig:
    """``adapter_config.json`` of the adapter folder ``path``, checked; AdapterError naming the
    setting this engine does not serve."""
    folder = Path(path)
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise AdapterError(f"{folder}: no adapter_config.json (a peft LoRA adapter folder)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{config_file}: not readable JSON ({exc})") from exc
    kind = config.get("peft_type")
    if kind != "LORA":
        raise AdapterError(f"{folder}: peft_type {kind!r}; only LoRA adapters are served")
    refusals = (
        ("use_dora", "DoRA adapters are not served"),
        ("lora_bias", "LoRA biases (lora_bias) are not served"),
        ("fan_in_fan_out", "fan_in_fan_out (Conv1D layouts) is not served"),
        ("modules_to_save", "modules_to_save {value} are not served (whole modules replaced)"),
        ("rank_pattern", "per-module ranks (rank_pattern {value}) are not served"),
        ("alpha_pattern", "per-module alphas (alpha_pattern {value}) are not served"),
        (
            "target_parameters",
            "LoRA on parameters (target_parameters {value}, a mixture of "
            "experts' experts) is not served",
        ),
    )
    for key, message in refusals:
        value = config.get(key)
        if value:
            raise AdapterError(f"{folder}: " + message.format(value=value))
    targets = config.get("target_modules") or []
    whole = sorted(set([targets] if isinstance(targets, str) else targets) & set(_WHOLE_MODULES))
    if whole:
        raise AdapterError(
            f"{folder}: target_modules {whole}: LoRA on the embeddings or the LM head is not served"
        )
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{folder}: bias {config['bias']!r}; only bias 'none' is served")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{folder}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"{folder}: rank {rank} is above --max-lora-rank {max_rank}")
    alpha = config.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise AdapterError(f"{folder}: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return AdapterConfig(rank, float(scaling), config.get("base_model_name_or_path"))


def read_weights(
    path: str | Path, config: AdapterConfig, targets: dict[str, TargetShape]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The adapter's matrices by module path: ``(A [r, in], scaling * B [out, r])`` in fp32 on
    the CPU, checked against ``targets`` (the served model's adaptable projections by path);
    AdapterError naming the first that does not fit."""
    folder = Path(path)
    weights_file = folder / "adapter_model.safetensors"
    if not weights_file.is_file():
        found = "adapter_model.bin" if (folder / "adapter_model.bin").is_file() else "none"
        raise AdapterError(f"{folder}: no adapter_model.safetensors (found {found})")
    try:
        tensors = load_file(str(weights_file))
    except Exception as exc:  # safetensors raises its own errors for a damaged file
        raise AdapterError(f"{weights_file}: not a readable safetensors file ({exc})") from exc
    sides: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise AdapterError(f"{weights_file}: {key!r} is not a LoRA matrix this engine serves")
        sides.setdefault(match["path"], {})[match["side"]] = tensor
    if not sides:
        raise AdapterError(f"{weights_file}: no LoRA matrices")
    pairs = {}
    for module, pair in sorted(sides.items()):
        target = targets.get(module)
        if target is None:
            raise AdapterError(f"{folder}: {_no_target(module)}")
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{folder}: {module} has lora_{''.join(pair)} alone")
        a, b = pair["A"], pair["B"]
        want_a = (config.rank, target.in_features)
        want_b = (target.out_features, config.rank)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise AdapterError(
                f"{folder}: {module} has lora_A {list(a.shape)} and lora_B {list(b.shape)}; "
                f"the served model's projection needs {list(want_a)} and {list(want_b)} "
                "(an adapter of another base model, or r that does not match the matrices)"
            )
        pairs[module] = (a.float(), b.float() * config.scaling)
    return pairs


def _no_target(module: str) -> str:
    """Why ``module`` cannot be adapted, for a refusal."""
    name = module.rsplit(".", 1)[-1]
    if ".experts." in f".{module}." or name == "experts":
        return f"{module}: LoRA on a mixture of experts' experts is not served"
    if name in _WHOLE_MODULES:
        return f"{module}: LoRA on the embeddings or the LM head is not served"
    return (
        f"{module}: the served model has no adaptable projection there (served: the decoder "
        "layers' attention and MLP projections; an adapter of another base model?)"
    )
