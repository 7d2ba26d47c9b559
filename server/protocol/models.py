"""``GET /v1/models`` and ``GET /v1/models/{id}``: the model cards."""

from __future__ import annotations

import msgspec


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int  # Unix seconds: when the server started
    owned_by: str = "paged-serve"
    max_model_len: int
    # How the checkpoint stores its weights (GPTQ, AWQ, compressed-tensors, FP8; null:
    # unquantized), as the start-up log says it
    quantization: str | None = None


class ModelList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard]
