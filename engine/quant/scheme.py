"""What a checkpoint's ``quantization_config`` says, as the engine serves it: which projections
are stored quantized, and how (``LinearScheme``). Each format's parser
(``engine/quant/formats.py``) makes a ``CheckpointQuantization``; an option it does not serve
is a ``ValueError`` naming it, raised before any weight is read."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True, slots=True)
class IntScheme:
    """Integer codes with a scale (and a zero point unless ``symmetric``) per ``group_size``
    inputs (-1: per output channel); activations stay in the model's dtype."""

    bits: int
    group_size: int
    symmetric: bool

    def describe(self) -> str:
        group = "channel" if self.group_size == -1 else f"g{self.group_size}"
        return f"W{self.bits}A16 {group}{'' if self.symmetric else ' asym'}"


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    """e4m3 weights with a scale per tensor, output channel or ``block`` (rows, columns);
    activations quantized per token (per token and ``block[1]`` inputs for block weights) on
    the GPU when ``quantize_activations``."""

    strategy: Literal["tensor", "channel", "block"]
    block: tuple[int, int] | None = None
    quantize_activations: bool = True

    def describe(self) -> str:
        weights = f"block {self.block[0]}x{self.block[1]}" if self.block else self.strategy
        return f"FP8 W8A{'8' if self.quantize_activations else '16'} {weights}"


@dataclass(frozen=True, slots=True)
class Int8Scheme:
    """int8 weights with one scale per output channel, activations quantized per token."""

    def describe(self) -> str:
        return "INT8 W8A8 channel"


LinearScheme = IntScheme | Fp8Scheme | Int8Scheme


@dataclass(frozen=True, slots=True)
class Targets:
    """Which modules a scheme covers: class names (``Linear``), exact module names, and
    ``re:`` patterns matched against the module's full name (compressed-tensors' rules)."""

    names: tuple[str, ...] = ("Linear",)

    def match(self, module: str, class_name: str = "Linear") -> bool:
        return any(_matches(rule, module, class_name) for rule in self.names)


def _matches(rule: str, module: str, class_name: str) -> bool:
    if rule.startswith("re:"):
        return re.match(rule[3:], module) is not None
    return rule in (class_name, module) or module.endswith("." + rule)


@dataclass(frozen=True, slots=True)
class CheckpointQuantization:
    """A quantized checkpoint's reading instructions.

    ``method``: ``quant_method`` (gptq, awq, compressed-tensors, fp8); ``storage``: how its
    tensors are laid out (gptq, gptq_v2, awq, pack-quantized, int-quantized, float-quantized,
    fp8); ``groups``: the schemes and the modules they cover (a target naming the module wins over
    one naming its class, then the first group); ``ignore``:
    modules stored unquantized whatever the groups say."""

    method: str
    storage: str
    groups: tuple[tuple[Targets, LinearScheme], ...]
    ignore: Targets = field(default_factory=lambda: Targets(()))

    def scheme_for(self, module: str) -> LinearScheme | None:
        """The scheme of the ``nn.Linear`` named ``module``, or None (stored unquantized)."""
        if self.ignore.match(module, class_name=""):
            return None
        # a target naming the module (or a ``re:`` pattern over its name) wins over one naming
        # its class, whatever the groups' order, as in compressed-tensors and vLLM
        for class_name in ("", "Linear"):
            for targets, scheme in self.groups:
                if targets.match(module, class_name):
                    return scheme
        return None

    def describe(self) -> str:
        """One line for the start-up log and ``/v1/models``: ``gptq (W4A16 g128)``."""
        schemes = sorted({scheme.describe() for _, scheme in self.groups})
        return f"{self.method} ({', '.join(schemes)})"
