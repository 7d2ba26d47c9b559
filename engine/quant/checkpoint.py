"""Which stored format a checkpoint is in, and one projection read from it.

``checkpoint_quantization`` reads ``config.json``'s ``quantization_config`` (with
``--quantization`` naming the method the user expects, as vLLM's flag does) into the reading
instructions before any weight is read; ``read_projection`` turns one projection's stored
tensors into the layout its kernels read (``engine/quant/weights.py``), or None where the
checkpoint stores it unquantized.
"""

from __future__ import annotations

from types import ModuleType

from paged_serve.engine.quant import awq, compressed, fp8, gptq
from paged_serve.engine.quant.scheme import CheckpointQuantization
from paged_serve.engine.quant.tensors import StoredTensors
from paged_serve.engine.quant.weights import QuantizedWeight

FORMATS: dict[str, ModuleType] = {
    "gptq": gptq,
    "awq": awq,
    "compressed-tensors": compressed,
    "fp8": fp8,
}
# --quantization names vLLM users pass for these checkpoints: the same reader here
ALIASES = {
    "gptq_marlin": "gptq",
    "awq_marlin": "awq",
    "compressed_tensors": "compressed-tensors",
}
# stored quantized but served otherwise (engine/model/loader.py): not a format read here
DEQUANTIZED_AT_LOAD = ("mxfp4",)


def checkpoint_quantization(
    config: dict | None, requested: str | None = None
) -> CheckpointQuantization | None:
    """The reading instructions of ``quantization_config`` (``config``: the dict as stored;
    None: an unquantized checkpoint), or None where this reader has nothing to do. A method this
    engine does not read, an option it does not serve, or a ``requested`` method (from
    ``--quantization``) that is not the checkpoint's is a ValueError naming it."""
    requested = ALIASES.get(requested, requested)
    method = None if config is None else str(config.get("quant_method") or "")
    if requested in FORMATS and method != requested:
        stored = f"stored as {method}" if method else "not stored quantized"
        raise ValueError(f"--quantization {requested}: the checkpoint is {stored}")
    if method is None or method in DEQUANTIZED_AT_LOAD:
        return None
    if method not in FORMATS:
        served = ", ".join((*FORMATS, *DEQUANTIZED_AT_LOAD))
        raise ValueError(
            f"quantization_config: quant_method {method!r} is not served (served: {served})"
        )
    return FORMATS[method].parse(config)


def is_stored_quantized(quant: CheckpointQuantization, tensors: StoredTensors, prefix: str) -> bool:
    """Whether the checkpoint stores projection ``prefix`` in its quantized form."""
    reader = FORMATS[quant.method]
    if hasattr(reader, "is_stored"):
        return reader.is_stored(tensors, prefix)
    return f"{prefix}.{reader.MARKER}" in tensors


def read_projection(
    quant: CheckpointQuantization, tensors: StoredTensors, prefix: str, module: str
) -> QuantizedWeight | None:
    """Projection ``module``'s weight (stored under ``prefix``) in its kernels' layout, or None
    where it is stored unquantized. A projection stored quantized that the config's groups do
    not cover is a ValueError naming it."""
    if not is_stored_quantized(quant, tensors, prefix):
        return None
    scheme = quant.scheme_for(module)
    if scheme is None:
        raise ValueError(
            f"{prefix} is stored quantized, but quantization_config's groups do not cover it"
        )
    return FORMATS[quant.method].read(tensors, prefix, scheme, quant.storage)


def projection_names(quant: CheckpointQuantization, prefix: str) -> tuple[str, ...]:
    """Every tensor name a quantized projection ``prefix`` may store (its bias aside)."""
    return FORMATS[quant.method].names(prefix)
