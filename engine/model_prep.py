"""Turn a loaded (and, under tensor parallelism, sharded) Hugging Face model into the one the
runner drives: paged attention swapped in, q/k/v and gate/up fused, int8 weights if asked, and
on the CPU the projections' faster exact kernels (engine/cpu_linears.py).

The driver and every tensor-parallel worker rank call this one function, so all ranks run the
same layout.
"""

from __future__ import annotations

import logging

import torch
from transformers import PreTrainedModel

from engine.attention_swap import install_paged_attention
from engine.config import EngineConfig
from engine.cpu_linears import speed_up_cpu_linears
from engine.fused_projections import fuse_projections
from engine.int8_weights import quantize_int8

logger = logging.getLogger(__name__)


def prepare_model(model: PreTrainedModel, config: EngineConfig, device: torch.device) -> None:
    """In place; ``device`` is where the model runs (int8 is refused off the CPU)."""
    install_paged_attention(model)
    fuse_projections(model)  # one GEMM for q/k/v and one for gate/up; exact
    if config.quantization == "int8":
        swapped = quantize_int8(model, device)
        logger.info("int8 weight-only: %d projections quantized", swapped)
    if device.type == "cpu":
        swapped = speed_up_cpu_linears(model)  # after int8, which leaves no nn.Linear to swap
        if swapped:
            logger.info("CPU projections on their faster exact kernels: %d", swapped)
