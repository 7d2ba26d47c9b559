"""Random-weight models with a real model's shapes, built on the spot (no download).

``python -m perf.engine.bench_e2e --model-shape qwen3-0.6b`` measures the engine on Qwen3-0.6B's
architecture where the checkpoint cannot be fetched (a GPU machine without internet). Speed
depends on the shapes, not on the weight values; greedy outputs of random weights are
meaningless text but still comparable token for token between systems.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from paged_serve.engine.model.loader import LoadedModel

# Qwen/Qwen3-0.6B's config.json (the fields that shape the compute).
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
}
_ROPE_THETA = 1_000_000.0


def _qwen3_config(shape: dict[str, Any]) -> Qwen3Config:
    try:  # transformers >= 5 names RoPE settings rope_parameters
        return Qwen3Config(
            **shape, rope_parameters={"rope_type": "default", "rope_theta": _ROPE_THETA}
        )
    except TypeError:
        return Qwen3Config(**shape, rope_theta=_ROPE_THETA)


def random_weight_model(
    name: str, *, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> LoadedModel:
    """The model ``name`` of :data:`MODEL_SHAPES` with random weights, ready for the engine.

    Initialised directly on ``device`` from ``seed``, so two calls give identical weights.
    No tokenizer: prompts are token ids.
    """
    if name not in MODEL_SHAPES:
        raise ValueError(f"unknown model shape {name!r}; choose from {sorted(MODEL_SHAPES)}")
    start = time.perf_counter()
    config = _qwen3_config(MODEL_SHAPES[name])
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    model = model.to(dtype=dtype).eval()
    return LoadedModel(
        model=model,
        tokenizer=None,
        name=f"random-{name}",
        eos_token_ids=(),
        max_model_len=int(config.max_position_embeddings),
        load_seconds=time.perf_counter() - start,
    )
