"""The OpenAI-client server tests again, on a tensor-parallel engine (gloo, CPU).

The default model, SmolLM2-135M-Instruct, has 9 query and 3 KV heads and an MLP of 1536: TP=3 is
the only size above 1 that divides them, so this folder serves it at TP=3 (three processes on
the CPU). The fixtures mirror ``tests/server/conftest.py``'s (same limits, same ``pool_clean``
check after every test) with package scope: a process holds one tensor-parallel engine at a
time, so this one stops before other folders start theirs. It shards a private copy of the
default model, since sharding rewrites the model in place and other engines share
``default_model``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import openai
import pytest

from paged_serve.engine.async_engine import AsyncEngine
from paged_serve.engine.config import EngineConfig
from paged_serve.engine.model.loader import LoadedModel
from paged_serve.server.app import create_app
from paged_serve.server.http.limits import ServerLimits
from tests.server.conftest import (  # noqa: F401  (pool_clean re-registered for this folder)
    KV_CACHE_BYTES,
    MAX_BODY_BYTES,
    MAX_MODEL_LEN,
    MAX_STORED_RESPONSES,
    ServerThread,
    pool_clean,
)

TENSOR_PARALLEL_SIZE = 3


@pytest.fixture(scope="package")
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


@pytest.fixture(scope="package")
def base_url(engine: AsyncEngine) -> Iterator[str]:
    thread = ServerThread()
    limits = ServerLimits(
        max_request_bytes=MAX_BODY_BYTES, max_stored_responses=MAX_STORED_RESPONSES
    )
    try:
        yield thread.serve(lambda: create_app(engine, limits=limits))
    finally:
        thread.close()


@pytest.fixture(scope="package")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="package")
def model_name(engine: AsyncEngine) -> str:
    return engine.model_name
