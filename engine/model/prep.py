"""Turn a loaded (and, under tensor parallelism, sharded) Hugging Face model into the one the
runner drives: paged attention and the fused mixture-of-experts swapped in, q/k/v and gate/up
fused, int8 or int4 weights if asked, and what the device's platform adds (on the CPU the
projections' faster exact kernels, engine/platform/cpu/linears.py).

The driver and every tensor-parallel worker rank call this one function, so all ranks run the
same layout.
"""

from __future__ import annotations

import logging

from transformers import PreTrainedModel

from paged_serve.engine.config import WEIGHT_ONLY_QUANTIZATIONS, EngineConfig
from paged_serve.engine.model.attention_swap import install_paged_attention
from paged_serve.engine.model.experts_swap import install_paged_experts
from paged_serve.engine.model.fused_projections import fuse_projections
from paged_serve.engine.model.int4_weights import quantize_int4
from paged_serve.engine.model.int8_weights import quantize_int8
from paged_serve.engine.platform.platform import Platform

logger = logging.getLogger(__name__)


def prepare_model(model: PreTrainedModel, config: EngineConfig, platform: Platform) -> None:
    """In place; ``platform`` is where the model runs (a quantization it does not run is
    refused)."""
    if config.quantization in WEIGHT_ONLY_QUANTIZATIONS:
        platform.check_quantization(config.quantization)
    install_paged_attention(model, pooling=config.runner == "pooling")
    experts = install_paged_experts(model)  # mixture-of-experts layers: the fused MoE
    if experts:
        logger.info("%d experts modules on the fused mixture-of-experts pass", experts)
    fuse_projections(model)  # one GEMM for q/k/v and one for gate/up; exact
    if config.quantization in WEIGHT_ONLY_QUANTIZATIONS:
        quantize = quantize_int8 if config.quantization == "int8" else quantize_int4
        swapped = quantize(model, platform)
        logger.info("%s weight-only: %d projections quantized", config.quantization, swapped)
    platform.prepare_model(model, config)  # after quantizing: packs what stays an nn.Linear
