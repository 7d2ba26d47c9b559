"""The OpenAI-client server tests again, on a tensor-parallel engine (gloo, CPU).

The default model, SmolLM2-135M-Instruct, has 9 query and 3 KV heads and an MLP of 1536: TP=3 is
the only size above 1 that divides them, so this folder serves it at TP=3 (three processes on
the CPU). The session's servers and checks are those of ``tests/server/conftest.py``,
re-registered here with an ``engine`` of their own: a private copy of the default model, since
sharding rewrites the model in place and other folders' engines share ``default_model``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.model_loader import LoadedModel
from tests.server.conftest import (  # noqa: F401  (fixtures, re-registered for this folder)
    KV_CACHE_BYTES,
    MAX_MODEL_LEN,
    base_url,
    client,
    keyed_url,
    model_name,
    pool_clean,
    server_thread,
)

TENSOR_PARALLEL_SIZE = 3


@pytest.fixture(scope="session")
def engine(default_model: LoadedModel) -> Iterator[AsyncEngine]:
    own = LoadedModel(
        copy.deepcopy(default_model.model),
        default_model.tokenizer,
        default_model.name,
        default_model.eos_token_ids,
        default_model.max_model_len,
        0.0,
    )
    config = EngineConfig(
        kv_cache_memory=KV_CACHE_BYTES // TENSOR_PARALLEL_SIZE,
        max_model_len=MAX_MODEL_LEN,
        tensor_parallel_size=TENSOR_PARALLEL_SIZE,
    )
    engine = AsyncEngine(config, loaded=own)
    yield engine
    engine.shutdown()
