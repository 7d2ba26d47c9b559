"""``paged-serve`` started as a user starts it for a pooling model: the reranker folder with
vLLM's ``--hf-overrides`` (a JSON object on the command line) scoring from its yes/no logits,
and an embedder made Matryoshka the same way."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest

from tests.pooling_models import RERANKER_OVERRIDES, qwen3_embedder
from tests.server.conftest import assert_error, http
from tests.server.pooling.conftest import Served
from tests.server.processes import READY, START_DEADLINE_S, ServerProcess


@contextmanager
def started(args: list[str]) -> Iterator[str]:
    """``paged-serve ARGS`` on a free port; its base URL while it runs."""
    server = ServerProcess(["--port", "0", "--kv-cache-memory", str(8 << 20), *args])
    try:
        yield server.wait_for(READY, START_DEADLINE_S).group("url")
    finally:
        server.stop()


@pytest.fixture(scope="module")
def matryoshka_cli(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = qwen3_embedder(tmp_path_factory.mktemp("cli") / "embedder")
    overrides = json.dumps({"is_matryoshka": True})
    args = ["--model", str(folder), "--dtype", "float32", "--hf-overrides", overrides]
    with started(args) as url:
        yield url


def test_hf_overrides_on_the_command_line(matryoshka_cli: str, reranker: Served):
    client = openai.OpenAI(base_url=f"{matryoshka_cli}/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    reply = client.embeddings.create(model=model, input=["w1 w2", "w3"], dimensions=8)
    assert [len(d.embedding) for d in reply.data] == [8, 8]
    chat = http("POST", f"{matryoshka_cli}/v1/chat/completions", json={"messages": []})
    assert "--runner generate" in assert_error(chat, 400)["message"]
    scored = _scores(reranker.folder, ["--runner", "pooling", "--convert", "classify"])
    assert scored == pytest.approx(_scores_of(reranker.url), abs=1e-5)  # as EngineConfig's


def _scores(folder: Path, flags: list[str]) -> list[float]:
    overrides = json.dumps(RERANKER_OVERRIDES)
    args = ["--model", str(folder), "--dtype", "float32", "--hf-overrides", overrides, *flags]
    with started(args) as url:
        return _scores_of(url)


def _scores_of(url: str) -> list[float]:
    reply = http("POST", f"{url}/score", json={"text_1": "w1 w2", "text_2": ["w3", "yes no"]})
    assert reply.status == 200, reply.body
    return [d["score"] for d in reply.json()["data"]]
