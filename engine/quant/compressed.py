"""compressed-tensors checkpoints (llm-compressor's; ``quant_method: "compressed-tensors"``).

``config_groups`` name schemes and the modules they target (class names such as ``Linear``,
module names, ``re:`` patterns); ``ignore`` lists modules stored unquantized. Served, per
projection of ``K`` inputs and ``N`` outputs:

* ``pack-quantized`` (W4A16, W8A16; group or channel scales; symmetric or with zero points)::

      weight_packed     [N, K / pack] int32  codes + 2^(bits-1), packed along K, low bits first
      weight_scale      [N, G]
      weight_zero_point [N / pack, G] int32  (asymmetric) zeros + 2^(bits-1), packed along N
      weight_g_idx      [K] int32            (act-order) each input's group
      weight_shape      [2] int64            (N, K)

  ``w = (q - zero) * scale``, the same offset on both sides, so the stored unsigned codes and
  zeros are the kernels' (symmetric: zero ``2^(bits-1)``);
* ``int-quantized`` (W8A8 int8): ``weight [N, K]`` int8 and ``weight_scale [N, 1]``, symmetric
  channel weights with activations quantized per token at run time;
* ``float-quantized`` (FP8): ``weight [N, K]`` e4m3 and ``weight_scale``: ``[1]`` (tensor),
  ``[N, 1]`` (channel) or ``[N / bn, K / bk]`` (block), activations dynamic per token (or per
  token and group for block weights), or none (W8A16).

Refused at start, naming the option: other formats (``naive-quantized``, NVFP4, MXFP4, 2:4
sparsity), static activation scales, output activations, a quantized KV cache
(``kv_cache_scheme``), transforms, and checkpoints not saved compressed.
"""

from __future__ import annotations

import torch

from paged_serve.engine.quant.scheme import (
    CheckpointQuantization,
    Fp8Scheme,
    Int8Scheme,
    IntScheme,
    LinearScheme,
    Targets,
)
from paged_serve.engine.quant.tensors import StoredTensors, expect_shape, refuse
from paged_serve.engine.quant.weights import (
    SUPPORTED_BITS,
    QuantizedWeight,
    ScaledFp8,
    ScaledInt8,
    packed_int,
    sorted_by_group,
    unpack_columns,
)

FORMATS = ("pack-quantized", "int-quantized", "float-quantized")
MARKERS = ("weight_packed", "weight_scale")


def parse(config: dict) -> CheckpointQuantization:
    """The reading instructions of a compressed-tensors ``quantization_config``."""
    status = config.get("quantization_status", "compressed")
    if status != "compressed":
        raise refuse(f"quantization_status={status!r}", "checkpoints saved compressed are")
    for option in ("kv_cache_scheme", "transform_config"):
        if config.get(option):
            raise refuse(f"compressed-tensors {option}", "weights are read, nothing else")
    sparsity = config.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise refuse(f"sparsity_config format={sparsity.get('format')!r}", "dense weights are")
    default_format = config.get("format")
    groups = []
    for name, group in (config.get("config_groups") or {}).items():
        storage = group.get("format") or default_format
        if storage not in FORMATS:
            raise refuse(f"compressed-tensors format={storage!r} ({name})", f"{FORMATS} are")
        if group.get("output_activations"):
            raise refuse(f"output_activations ({name})", "inputs alone are quantized")
        scheme = _scheme(name, storage, group.get("weights") or {}, group.get("input_activations"))
        groups.append((Targets(tuple(group.get("targets") or ())), scheme))
    if not groups:
        raise refuse("compressed-tensors without config_groups", "nothing says what is stored")
    storages = sorted({g.get("format") or default_format for g in config["config_groups"].values()})
    ignore = Targets(tuple(config.get("ignore") or ()))
    return CheckpointQuantization("compressed-tensors", "+".join(storages), tuple(groups), ignore)


def _scheme(name: str, storage: str, weights: dict, activations: dict | None) -> LinearScheme:
    """One config group's scheme, or the refusal naming what it asks for."""
    kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
    where = f"{name}: {kind} {bits}-bit {strategy} weights"
    if storage == "pack-quantized":
        if kind != "int" or bits not in SUPPORTED_BITS or strategy not in ("group", "channel"):
            raise refuse(where, "pack-quantized reads 4/8-bit int group or channel weights")
        if activations:
            raise refuse(f"{name}: quantized activations on pack-quantized weights", "W4A16")
        group_size = weights.get("group_size") if strategy == "group" else -1
        return IntScheme(bits=bits, group_size=group_size, symmetric=weights.get("symmetric", True))
    _dynamic_activations(name, activations)
    if storage == "int-quantized":
        if kind != "int" or bits != 8 or strategy != "channel" or not weights.get("symmetric"):
            raise refuse(where, "int-quantized reads symmetric int8 channel weights")
        if not activations or activations.get("type") != "int":
            raise refuse(f"{name}: int8 weights without int8 activations", "W8A8 is")
        return Int8Scheme()
    if kind != "float" or bits != 8 or strategy not in ("tensor", "channel", "block"):
        raise refuse(where, "float-quantized reads FP8 tensor, channel or block weights")
    block = tuple(weights.get("block_structure") or ()) or None
    if (strategy == "block") != (block is not None and len(block) == 2):
        raise refuse(f"{where} with block_structure={block}", "block weights name [rows, cols]")
    return Fp8Scheme(strategy=strategy, block=block, quantize_activations=bool(activations))


def _dynamic_activations(name: str, activations: dict | None) -> None:
    """Activations quantized at run time per token (or token group) are served; static scales
    stored in the checkpoint are not."""
    if activations and not activations.get("dynamic"):
        raise refuse(f"{name}: static activation scales (input_scale)", "dynamic ones are")


def is_stored(tensors: StoredTensors, prefix: str) -> bool:
    """Whether projection ``prefix`` is stored quantized (packed codes or a weight scale)."""
    return any(f"{prefix}.{marker}" in tensors for marker in MARKERS)


def names(prefix: str) -> tuple[str, ...]:
    """The tensors a compressed-tensors projection may store (its bias aside)."""
    kept = ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape")
    return (f"{prefix}.weight", *(f"{prefix}.{n}" for n in kept))


def read(
    tensors: StoredTensors, prefix: str, scheme: LinearScheme, storage: str
) -> QuantizedWeight:
    """Projection ``prefix``'s weight in its layout (``engine/quant/weights.py``)."""
    del storage  # the scheme says which
    if isinstance(scheme, IntScheme):
        return _packed(tensors, prefix, scheme)
    weight = tensors.get(f"{prefix}.weight")
    scale = tensors.get(f"{prefix}.weight_scale").float()
    n, k = weight.shape
    if isinstance(scheme, Int8Scheme):
        if weight.dtype != torch.int8:
            raise ValueError(f"{prefix}.weight is {weight.dtype}, int-quantized stores int8")
        return ScaledInt8(weight, expect_shape(scale, (n, 1), f"{prefix}.weight_scale")[:, 0])
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{prefix}.weight is {weight.dtype}, float-quantized stores e4m3")
    if scheme.strategy == "tensor":
        return ScaledFp8(weight, scale.reshape(()), None)
    if scheme.strategy == "channel":
        return ScaledFp8(weight, expect_shape(scale, (n, 1), f"{prefix}.weight_scale")[:, 0], None)
    bn, bk = scheme.block
    blocks = (-(-n // bn), -(-k // bk))
    return ScaledFp8(weight, expect_shape(scale, blocks, f"{prefix}.weight_scale"), (bn, bk))


def _packed(tensors: StoredTensors, prefix: str, scheme: IntScheme):
    """A pack-quantized projection, repacked along K."""
    bits = scheme.bits
    n, k = (int(v) for v in tensors.get(f"{prefix}.weight_shape").tolist())
    codes = unpack_columns(tensors.get(f"{prefix}.weight_packed"), bits)[:, :k]  # [N, K]
    expect_shape(codes, (n, k), f"{prefix}.weight_packed (unpacked)")
    group_size = k if scheme.group_size == -1 else scheme.group_size
    if k % group_size:
        raise ValueError(f"{prefix}: group_size {group_size} does not divide its {k} inputs")
    groups = k // group_size
    scale = expect_shape(
        tensors.get(f"{prefix}.weight_scale"), (n, groups), f"{prefix}.weight_scale"
    )
    zeros = None
    if not scheme.symmetric:
        packed_zeros = tensors.get(f"{prefix}.weight_zero_point")  # packed along N
        zeros = unpack_columns(packed_zeros.t().contiguous(), bits)[:, :n]  # [G, N]
        expect_shape(zeros, (groups, n), f"{prefix}.weight_zero_point (unpacked)")
    codes = codes.t()
    perm = None
    if f"{prefix}.weight_g_idx" in tensors:
        g_idx = expect_shape(tensors.get(f"{prefix}.weight_g_idx"), (k,), f"{prefix}.weight_g_idx")
        codes, perm = sorted_by_group(codes, g_idx, group_size, prefix)
    return packed_int(
        codes.contiguous(), scale.t(), zeros, bits=bits, group_size=scheme.group_size, perm=perm
    )
