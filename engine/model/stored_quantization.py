"""How a checkpoint says its weights are stored quantized: ``config.json``'s
``quantization_config`` (a dict as read from the file, or the quantizer config object
transformers builds from it), named by its ``quant_method``."""

from __future__ import annotations

from typing import Any


def stored_quantization(config: Any) -> str | None:
    """The ``quant_method`` of ``config``'s ``quantization_config`` (``"mxfp4"``, ``"gptq"``,
    ...), ``""`` for one that names none, None for a checkpoint stored unquantized."""
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return None
    if isinstance(quant, dict):
        method = quant.get("quant_method")
    else:  # transformers' quantizer config: its quant_method is a str enum
        method = getattr(quant, "quant_method", None)
    return str(getattr(method, "value", method) or "")
