"""How much a quantized KV cache moves the default model's predictions over real text (this
project's LICENSE, 1500 tokens teacher-forced): top-1 agreement with the model-dtype cache and
the mean |delta logprob| of the text's own tokens. The floors are loose (a wrong scale, a
swapped K and V or codes read as values fail them by far); the figures themselves are
docs/performance.md's, from ``perf/engine/bench_kv_cache.py``."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest

from paged_serve.engine.llm import LLM
from paged_serve.engine.model.loader import LoadedModel
from perf.engine.kv_agreement import agreement

TEXT = Path(__file__).parents[3] / "LICENSE"
TOKENS = 1500


def engine(default_model: LoadedModel, kv_cache_dtype: str) -> LLM:
    private = dataclasses.replace(default_model, model=copy.deepcopy(default_model.model))
    return LLM(loaded=private, kv_cache_memory=128 << 20, kv_cache_dtype=kv_cache_dtype)


@pytest.fixture(scope="module")
def tokens(default_model: LoadedModel) -> list[int]:
    ids = default_model.tokenizer(TEXT.read_text()).input_ids
    assert len(ids) >= TOKENS
    return ids[:TOKENS]


@pytest.fixture(scope="module")
def reference(default_model: LoadedModel) -> LLM:
    return engine(default_model, "auto")


@pytest.mark.parametrize(("name", "floor", "ceiling"), [("int8", 0.97, 0.05), ("fp8", 0.9, 0.2)])
def test_predictions_stay_close(default_model, reference, tokens, name, floor, ceiling):
    got = agreement(reference, engine(default_model, name), tokens)
    assert got.positions == TOKENS - 1
    assert got.top1 >= floor, got
    assert got.mean_abs_logprob <= ceiling, got
    print(name, got)
