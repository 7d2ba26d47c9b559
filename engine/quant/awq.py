"""AWQ checkpoints (AutoAWQ's GEMM layout; ``quant_method: "awq"``), 4 bits.

Per projection of ``K`` inputs and ``N`` outputs, in ``G`` groups of ``group_size`` inputs::

    qweight [K, N / 8] int32   codes packed along N: bits 4i..4i+3 of word j hold output
                               column 8j + ORDER[i], ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
    qzeros  [G, N / 8] int32   zero points, packed the same way
    scales  [G, N] fp16

``w[n, k] = (q[k, n] - zero[k // group_size, n]) * scale[k // group_size, n]``. The codes are
repacked along K at load (the kernels' layout). The GEMV, Marlin and ExLlama layouts
(``version``) are refused at start.
"""

from __future__ import annotations

from paged_serve.engine.quant.scheme import CheckpointQuantization, IntScheme, Targets
from paged_serve.engine.quant.tensors import StoredTensors, expect_shape, refuse
from paged_serve.engine.quant.weights import PackedInt, packed_int, unpack_columns

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output column each nibble of a word holds
BITS = 4
MARKER = "qweight"  # a projection stored quantized has it


def parse(config: dict) -> CheckpointQuantization:
    """The reading instructions of an AWQ ``quantization_config``."""
    bits = config.get("bits", config.get("w_bit"))
    if bits != BITS:
        raise refuse(f"awq bits={bits}", "AWQ is read at 4 bits")
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise refuse(f"awq version={version!r}", "the GEMM layout is")
    group_size = config.get("group_size", config.get("q_group_size", 128))
    if not isinstance(group_size, int) or (group_size != -1 and group_size <= 0):
        raise refuse(f"awq group_size={group_size!r}", "a positive size or -1 is expected")
    symmetric = not config.get("zero_point", True)
    scheme = IntScheme(bits=BITS, group_size=group_size, symmetric=symmetric)
    ignore = Targets(tuple(config.get("modules_to_not_convert") or ()))
    return CheckpointQuantization("awq", "awq", ((Targets(), scheme),), ignore)


def names(prefix: str) -> tuple[str, ...]:
    """The tensors an AWQ projection stores (its bias aside)."""
    return tuple(f"{prefix}.{n}" for n in ("qweight", "qzeros", "scales"))


def read(tensors: StoredTensors, prefix: str, scheme: IntScheme, storage: str) -> PackedInt:
    """Projection ``prefix``'s weight in the kernels' layout (``engine/quant/weights.py``)."""
    del storage  # one layout
    codes = unpack_columns(tensors.get(f"{prefix}.qweight"), BITS, ORDER)  # [K, N]
    k, n = codes.shape
    group_size = k if scheme.group_size == -1 else scheme.group_size
    if k % group_size:
        raise ValueError(f"{prefix}: group_size {group_size} does not divide its {k} inputs")
    groups = k // group_size
    scales = expect_shape(tensors.get(f"{prefix}.scales"), (groups, n), f"{prefix}.scales")
    zeros = None
    if f"{prefix}.qzeros" in tensors:
        zeros = unpack_columns(tensors.get(f"{prefix}.qzeros"), BITS, ORDER)
        expect_shape(zeros, (groups, n), f"{prefix}.qzeros (unpacked)")
    return packed_int(codes, scales, zeros, bits=BITS, group_size=scheme.group_size)
