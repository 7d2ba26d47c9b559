"""LoRA adapters for the tests, made by peft over the tiny random models: folders as peft saves
them, and peft's merged model (the base plus ``scaling * B A``) as each adapter's reference."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import PreTrainedModel

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base: PreTrainedModel,
    folder: Path,
    *,
    seed: int,
    rank: int = 8,
    alpha: int = 16,
    targets: list[str] | None = None,
    std: float = 0.05,
    **options: object,
) -> PreTrainedModel:
    """Save a LoRA adapter of ``base`` in ``folder`` (random ``A`` and ``B`` of ``std``, so it
    changes the outputs: peft's ``init_lora_weights=False``) and return peft's merged model in
    fp32 (``base`` is not touched). ``options``: more ``LoraConfig`` fields."""
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets or ALL_PROJECTIONS,
        init_lora_weights=False,
        **options,
    )
    peft_model = get_peft_model(copy.deepcopy(base), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    peft_model.save_pretrained(str(folder))
    return peft_model.merge_and_unload().eval()
