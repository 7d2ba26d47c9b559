"""Building a model runner: load the weights the platform's way, prepare the model, make the runner.

The engine (rank 0) and every tensor-parallel worker rank build theirs with these functions, so
every rank loads in the same dtype, derives the same context length and prepares the same
layout::

    load_for(config, platform, rank)      -> LoadedModel (under tensor parallelism: the rank's
                                             shard read alone, each tensor straight to the
                                             rank's device, or the whole model on the CPU)
    (shard_model of a whole model, under tensor parallelism)
    build_runner(model, config, platform) -> prepare_model, LoRA adapter slots (--enable-lora),
                                             onto the device, ModelRunner
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedModel

from paged_serve.engine.config import EngineConfig
from paged_serve.engine.lora.model_adapters import ModelAdapters
from paged_serve.engine.model.loader import LoadedModel, load_model, load_model_shard
from paged_serve.engine.model.prep import prepare_model
from paged_serve.engine.parallel.group import TensorParallelGroup
from paged_serve.engine.platform.platform import Platform
from paged_serve.engine.pooling.pooling_model import PoolingModel
from paged_serve.engine.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def load_for(config: EngineConfig, platform: Platform, rank: int = 0) -> LoadedModel:
    """``config.model`` in the platform's dtype for ``config.dtype``, on the platform's device.
    Under tensor parallelism, tensor-parallel rank ``rank``'s shard alone, read from the
    checkpoint's files tensor by tensor onto the platform's device (the rank's own GPU for a
    worker), where they can be read name for name (``LoadedModel.shard`` says so), else the
    whole model on the CPU, where only shards ever go to a device."""
    choice = platform.dtype(config.dtype)
    logger.info("weights in %s", choice)
    world = config.tensor_parallel_size
    if world > 1:
        shard = load_model_shard(
            config.model,
            dtype=choice.dtype,
            rank=rank,
            world_size=world,
            device=platform.device,
            quantization=config.quantization,
            **task_options(config),
        )
        if shard is not None:
            return shard
        return load_model(
            config.model,
            dtype=choice.dtype,
            device=torch.device("cpu"),
            quantization=config.quantization,
            **task_options(config),
        )
    return load_model(
        config.model,
        dtype=choice.dtype,
        device=platform.device,
        quantization=config.quantization,
        **task_options(config),
    )


def task_options(config: EngineConfig) -> dict[str, object]:
    """The loader's options of what the model is served for (engine/model/model_task.py)."""
    return {"runner": config.runner, "convert": config.convert, "hf_overrides": config.hf_overrides}


def context_length(config: EngineConfig, native: int) -> int:
    """The context length served (tokens): ``--max-model-len`` if set, never past the model's
    own ``native``."""
    return min(config.max_model_len or native, native)


def build_runner(
    model: PreTrainedModel,
    config: EngineConfig,
    platform: Platform,
    *,
    max_model_len: int,
    eos_token_ids: Sequence[int] = (),
    group: Callable[[], TensorParallelGroup | None] = lambda: None,
    pooling: Callable[[PreTrainedModel], PoolingModel] | None = None,
) -> ModelRunner:
    """Prepare ``model`` (loaded, and sharded under tensor parallelism) in place, move it to
    the platform's device and make its runner. ``group`` is called once the model is prepared
    and gives the tensor-parallel group the runner steps with (a worker rank reports itself
    loaded and joins then); None without tensor parallelism. ``pooling`` builds a pooling
    model's pipeline once the model is on its device (the driver's runner pools)."""
    prepare_model(model, config, platform)
    tp = group()
    adapters = None
    if config.lora is not None:  # last: the adapters wrap the projections as prepared
        dtype = next(model.parameters()).dtype
        where = {} if tp is None else {"rank": tp.rank, "world_size": tp.world_size}
        adapters = ModelAdapters(model, config.lora, dtype, **where)
    model.to(platform.device)
    return ModelRunner(
        model,
        config,
        platform,
        max_model_len=max_model_len,
        eos_token_ids=tuple(eos_token_ids),
        tp=tp,
        pooling=None if pooling is None else pooling(model),
        adapters=adapters,
    )
