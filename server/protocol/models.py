"""``GET /v1/models`` and ``GET /v1/models/{id}``: the model cards (the base model's served
names, then each served LoRA adapter's)."""

from __future__ import annotations

import msgspec


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int  # Unix seconds: when the server started
    owned_by: str = "paged-serve"
    # vLLM's: the base model's folder or id, or a LoRA adapter's folder
    root: str | None = None
    # vLLM's: a LoRA adapter's base model (its first served name, or the adapter's own
    # base_model_name); null for the base model
    parent: str | None = None
    max_model_len: int
    # How the checkpoint stores its weights (GPTQ, AWQ, compressed-tensors, FP8; null:
    # unquantized), as the start-up log says it
    quantization: str | None = None


class ModelList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard]
