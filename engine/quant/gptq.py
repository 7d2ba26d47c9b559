"""GPTQ checkpoints (AutoGPTQ, GPTQModel; ``quant_method: "gptq"``), 4 or 8 bits.

Per projection of ``K`` inputs and ``N`` outputs, with ``pack = 32 / bits`` and ``G`` groups::

    qweight [K / pack, N] int32   codes packed along K, low bits first (the kernels' layout)
    qzeros  [G, N / pack] int32   zero points packed along N, low bits first; the original
                                  format ("gptq", v1) stores zero - 1, "gptq_v2" the zero
    scales  [G, N] fp16
    g_idx   [K] int32             each input's group (act-order, ``desc_act``: not sorted)
    bias    [N] (optional)

``w[n, k] = (q[k, n] - zero[g_idx[k], n]) * scale[g_idx[k], n]``; ``sym`` checkpoints hold the
zero ``2^(bits-1)`` everywhere. Marlin-repacked, BitBLAS and per-module (``dynamic``) variants
are refused at start.
"""

from __future__ import annotations

from paged_serve.engine.quant.scheme import CheckpointQuantization, IntScheme, Targets
from paged_serve.engine.quant.tensors import StoredTensors, expect_shape, refuse
from paged_serve.engine.quant.weights import (
    SUPPORTED_BITS,
    PackedInt,
    packed_int,
    sorted_by_group,
    unpack_columns,
)
from paged_serve.kernels.reference import unpack_int_ref

STORAGES = ("gptq", "gptq_v2")
MARKER = "qweight"  # a projection stored quantized has it


def parse(config: dict) -> CheckpointQuantization:
    """The reading instructions of a GPTQ ``quantization_config``."""
    bits = config.get("bits")
    if bits not in SUPPORTED_BITS:
        raise refuse(f"gptq bits={bits}", f"4 and 8 bits are, {SUPPORTED_BITS}")
    group_size = config.get("group_size", -1)
    if not isinstance(group_size, int) or (group_size != -1 and group_size <= 0):
        raise refuse(f"gptq group_size={group_size!r}", "a positive size or -1 is expected")
    storage = config.get("checkpoint_format") or config.get("format") or "gptq"
    if storage not in STORAGES or config.get("is_marlin_format"):
        raise refuse(f"gptq checkpoint_format={storage!r}", f"{' and '.join(STORAGES)} are")
    if config.get("dynamic"):
        raise refuse("gptq dynamic (per-module bits and groups)", "one scheme for all is")
    scheme = IntScheme(bits=bits, group_size=group_size, symmetric=bool(config.get("sym", True)))
    ignore = Targets(tuple(config.get("modules_to_not_convert") or ()))
    return CheckpointQuantization("gptq", storage, ((Targets(), scheme),), ignore)


def names(prefix: str) -> tuple[str, ...]:
    """The tensors a GPTQ projection stores (its bias aside)."""
    return tuple(f"{prefix}.{n}" for n in ("qweight", "qzeros", "scales", "g_idx"))


def read(tensors: StoredTensors, prefix: str, scheme: IntScheme, storage: str) -> PackedInt:
    """Projection ``prefix``'s weight in the kernels' layout (``engine/quant/weights.py``)."""
    bits = scheme.bits
    qweight = tensors.get(f"{prefix}.qweight")
    codes = unpack_int_ref(qweight, bits)  # [K, N]
    k, n = codes.shape
    group_size = k if scheme.group_size == -1 else scheme.group_size
    if k % group_size:
        raise ValueError(f"{prefix}: group_size {group_size} does not divide its {k} inputs")
    groups = k // group_size
    scales = expect_shape(tensors.get(f"{prefix}.scales"), (groups, n), f"{prefix}.scales")
    qzeros = tensors.get(f"{prefix}.qzeros")
    zeros = unpack_columns(qzeros, bits)[:, :n]
    expect_shape(zeros, (groups, n), f"{prefix}.qzeros (unpacked)")
    if storage == "gptq":  # v1 stores zero - 1 (a zero of 0 wraps to the top code)
        zeros = (zeros + 1) & ((1 << bits) - 1)
    perm = None
    if f"{prefix}.g_idx" in tensors:
        g_idx = expect_shape(tensors.get(f"{prefix}.g_idx"), (k,), f"{prefix}.g_idx")
        codes, perm = sorted_by_group(codes, g_idx, group_size, prefix)
    return packed_int(codes, scales, zeros, bits=bits, group_size=scheme.group_size, perm=perm)
