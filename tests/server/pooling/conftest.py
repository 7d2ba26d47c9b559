"""Pooling servers on the tiny checkpoints of ``tests/pooling_models.py``, each an in-process
server (the session's ``ServerThread``, the CLI's ``make_runner``) over its own engine, built on
first use: a Qwen3 embedder (sentence-transformers folder, last-token pooling), the same folder
made Matryoshka through ``hf_overrides``, a three-label Qwen3 sequence classifier, a one-label
one (a cross-encoder's shape), a Qwen3-Reranker-style LM scored from its yes/no logits, the
reranker's folder served for generation (the wrong-kind refusals), and bidirectional encoders:
a BERT embedder (mean pooling), a BERT cross-encoder (segment ids) and an XLM-RoBERTa one
(bge-reranker-v2-m3's shape).

After every test, ``pools_clean`` waits (bounded) until each engine the test used is idle,
then checks its block pool's integrity and that no block is still used.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from paged_serve.engine.async_engine import AsyncEngine
from paged_serve.engine.config import EngineConfig
from paged_serve.server.app import create_app
from tests.pooling_models import (
    RERANKER_OVERRIDES,
    bert_cross_encoder,
    bert_embedder,
    qwen3_classifier,
    qwen3_embedder,
    qwen3_reranker,
    xlm_roberta_cross_encoder,
)
from tests.server.conftest import ServerThread, wait_idle

MAX_MODEL_LEN = 64  # short, so an over-long input is a short string
KV_CACHE_BYTES = 8 << 20
PROMPTS = {"query": "query: "}


@dataclass(frozen=True)
class Served:
    """A pooling model served in-process: its folder, engine, base URL (without /v1) and
    served name."""

    folder: Path
    engine: AsyncEngine
    url: str
    name: str


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pooling-models")


def _serve(
    server_thread: ServerThread, folder: Path, name: str, **config: object
) -> Iterator[Served]:
    engine = AsyncEngine(
        EngineConfig(
            model=str(folder),
            dtype="float32",
            kv_cache_memory=KV_CACHE_BYTES,
            max_model_len=MAX_MODEL_LEN,
            **config,
        )
    )
    url = server_thread.serve(lambda: create_app(engine, served_model_name=name))
    yield Served(folder, engine, url, name)
    engine.shutdown()


@pytest.fixture(scope="session")
def embedder(model_root: Path, server_thread: ServerThread) -> Iterator[Served]:
    folder = qwen3_embedder(model_root / "embedder", prompts=PROMPTS)
    yield from _serve(server_thread, folder, "tiny-embedder")


@pytest.fixture(scope="session")
def matryoshka(embedder: Served, server_thread: ServerThread) -> Iterator[Served]:
    yield from _serve(
        server_thread, embedder.folder, "tiny-matryoshka", hf_overrides={"is_matryoshka": True}
    )


@pytest.fixture(scope="session")
def classifier(model_root: Path, server_thread: ServerThread) -> Iterator[Served]:
    folder = qwen3_classifier(model_root / "classifier", num_labels=3)
    yield from _serve(server_thread, folder, "tiny-classifier")


@pytest.fixture(scope="session")
def cross_encoder(model_root: Path, server_thread: ServerThread) -> Iterator[Served]:
    """A one-label Qwen3ForSequenceClassification: a score per pair, from its logit."""
    folder = qwen3_classifier(model_root / "cross-encoder", num_labels=1, seed=1)
    yield from _serve(server_thread, folder, "tiny-cross-encoder")


@pytest.fixture(scope="session")
def reranker(model_root: Path, server_thread: ServerThread) -> Iterator[Served]:
    folder = qwen3_reranker(model_root / "reranker", seed=2)
    yield from _serve(server_thread, folder, "tiny-reranker", hf_overrides=RERANKER_OVERRIDES)


@pytest.fixture(scope="session")
def generator(reranker: Served, server_thread: ServerThread) -> Iterator[Served]:
    """The reranker's causal LM served as what it is without overrides: a text generator."""
    yield from _serve(server_thread, reranker.folder, "tiny-generator")


@pytest.fixture(scope="session")
def bert(model_root: Path, server_thread: ServerThread) -> Iterator[Served]:
    folder = bert_embedder(model_root / "bert", seed=3)
    yield from _serve(server_thread, folder, "tiny-bert")


def _peaked(folder: Path) -> Path:
    """The classifier at ``folder`` with its matrices scaled 10x: a random encoder at the
    default initialisation gives every pair nearly the same score (0.4979 +- 1e-4), too close
    for an order to mean anything; scaled, the scores spread over 0.3-0.9."""
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() == 2:
                weight.mul_(10.0)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def bert_reranker(model_root: Path, server_thread: ServerThread) -> Iterator[Served]:
    folder = _peaked(bert_cross_encoder(model_root / "bert-cross-encoder", seed=4))
    yield from _serve(server_thread, folder, "tiny-bert-cross-encoder")


@pytest.fixture(scope="session")
def roberta_reranker(model_root: Path, server_thread: ServerThread) -> Iterator[Served]:
    folder = _peaked(xlm_roberta_cross_encoder(model_root / "xlm-roberta-cross-encoder", seed=5))
    yield from _serve(server_thread, folder, "tiny-xlm-roberta-cross-encoder")


SERVED = (
    "embedder",
    "matryoshka",
    "classifier",
    "cross_encoder",
    "reranker",
    "generator",
    "bert",
    "bert_reranker",
    "roberta_reranker",
)


def check_pool(engine: AsyncEngine) -> None:
    """The engine is idle, its block pool intact and no block used."""
    wait_idle(engine)
    engine.check_integrity()
    assert engine.snapshot().kv_blocks_used == 0


@pytest.fixture(autouse=True)
def pools_clean(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    for name in SERVED:
        if name in request.fixturenames:
            check_pool(request.getfixturevalue(name).engine)
