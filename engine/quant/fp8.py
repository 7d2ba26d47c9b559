"""Fine-grained FP8 checkpoints (``quant_method: "fp8"``: DeepSeek-V3, Qwen3-FP8 and the other
official FP8 releases; transformers' ``FineGrainedFP8Config``).

Per projection of ``K`` inputs and ``N`` outputs, with ``weight_block_size = [bn, bk]``::

    weight            [N, K] float8_e4m3fn
    weight_scale_inv  [ceil(N / bn), ceil(K / bk)] fp32     w = weight * scale[n // bn, k // bk]

(the name says "inverse" but the scale multiplies). Without ``weight_block_size`` one scale
covers the tensor (``weight_scale_inv`` or ``weight_scale``, one element). Activations are
quantized per token and ``bk`` inputs at run time (``activation_scheme: "dynamic"``); static
activation scales are refused at start.
"""

from __future__ import annotations

import torch

from paged_serve.engine.quant.scheme import CheckpointQuantization, Fp8Scheme, Targets
from paged_serve.engine.quant.tensors import StoredTensors, expect_shape, refuse
from paged_serve.engine.quant.weights import ScaledFp8

SCALE_NAMES = ("weight_scale_inv", "weight_scale")


def parse(config: dict) -> CheckpointQuantization:
    """The reading instructions of an ``fp8`` ``quantization_config``."""
    activations = config.get("activation_scheme", "dynamic")
    if activations != "dynamic":
        raise refuse(f"fp8 activation_scheme={activations!r}", "dynamic activations are")
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise refuse(f"fp8 fmt={fmt!r}", "e4m3 weights are")
    block = config.get("weight_block_size")
    if block is not None and (len(block) != 2 or min(block) <= 0):
        raise refuse(f"fp8 weight_block_size={block}", "two positive sizes are expected")
    scheme = Fp8Scheme("block", tuple(block)) if block else Fp8Scheme("tensor")
    ignore = Targets(tuple(config.get("modules_to_not_convert") or ()))
    return CheckpointQuantization("fp8", "fp8", ((Targets(), scheme),), ignore)


def is_stored(tensors: StoredTensors, prefix: str) -> bool:
    """Whether projection ``prefix`` is stored as FP8 (it has a weight scale)."""
    return any(f"{prefix}.{name}" in tensors for name in SCALE_NAMES)


def names(prefix: str) -> tuple[str, ...]:
    return (f"{prefix}.weight", *(f"{prefix}.{name}" for name in SCALE_NAMES))


def read(tensors: StoredTensors, prefix: str, scheme: Fp8Scheme, storage: str) -> ScaledFp8:
    """Projection ``prefix``'s e4m3 weight and scale (``engine/quant/weights.py``)."""
    del storage
    weight = tensors.get(f"{prefix}.weight")
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{prefix}.weight is {weight.dtype}, an fp8 checkpoint stores e4m3")
    name = next(f"{prefix}.{n}" for n in SCALE_NAMES if f"{prefix}.{n}" in tensors)
    scale = tensors.get(name).float()
    if scheme.block is None:
        return ScaledFp8(weight, expect_shape(scale.reshape(-1), (1,), name).reshape(()), None)
    (n, k), (bn, bk) = weight.shape, scheme.block
    return ScaledFp8(weight, expect_shape(scale, (-(-n // bn), -(-k // bk)), name), (bn, bk))
