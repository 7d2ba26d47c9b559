"""A tiny random Llama saved to a folder with LoRA adapters made by peft, served in-process
(the session's ``ServerThread``) with ``--enable-lora``: ``a1`` and ``a2`` from the start
(``--lora-modules``), ``a3`` on disk for runtime loading, and adapters the engine must refuse
(rank above ``--max-lora-rank``, DoRA). One engine, three servers over it: runtime updates on
(``VLLM_ALLOW_RUNTIME_LORA_UPDATING=true`` while the app is built), the same with API keys,
and one without the environment variable.

The references are peft's merged models (the base plus ``scaling * B A``) in fp32, run
greedily token by token. After every test the engine must be idle with its block pool and
adapter slots intact (``AsyncEngine.check_integrity``) and no block used.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from paged_serve.engine.async_engine import AsyncEngine
from paged_serve.engine.config import EngineConfig
from paged_serve.engine.lora.config import LoRAConfig, LoRAModule
from paged_serve.server.app import create_app
from paged_serve.server.lora.runtime_updates import RUNTIME_LORA_ENV
from perf.engine.pooling_models import word_tokenizer
from tests.conftest import tiny_model
from tests.lora_adapters import make_adapter
from tests.pooling_models import WORDS
from tests.server.conftest import ServerThread, wait_idle

BASE_NAME = "tiny-llama"
API_KEY = "sk-lora"
MAX_LORA_RANK = 16
# each message's text, then a generation prompt of one word
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}w1{% endif %}"
)


@dataclass(frozen=True)
class LoRAModels:
    """The base folder and adapter folders on disk, and the reference model of each name
    (``BASE_NAME`` for the base model)."""

    base: Path
    adapters: dict[str, Path]
    references: dict[str, PreTrainedModel]
    tokenizer: PreTrainedTokenizerFast


@dataclass(frozen=True)
class LoRAServers:
    """The engine and its servers' base URLs (without /v1)."""

    engine: AsyncEngine
    url: str  # runtime updates on
    keyed_url: str  # runtime updates on, API key API_KEY required
    plain_url: str  # no VLLM_ALLOW_RUNTIME_LORA_UPDATING


@pytest.fixture(scope="session")
def lora_models(tmp_path_factory: pytest.TempPathFactory) -> LoRAModels:
    root = tmp_path_factory.mktemp("lora-models")
    base = tiny_model("llama", vocab_size=len(WORDS))
    tokenizer = word_tokenizer(WORDS, encoder=False)
    tokenizer.chat_template = CHAT_TEMPLATE
    base.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    references: dict[str, PreTrainedModel] = {BASE_NAME: base}
    adapters: dict[str, Path] = {}
    for seed, name in enumerate(("a1", "a2", "a3"), start=1):
        adapters[name] = root / name
        # a2 adapts the attention only, at another rank: slots pad lanes and parts with zeros
        options = {"rank": 4, "targets": ["q_proj", "v_proj"]} if name == "a2" else {}
        references[name] = make_adapter(base, adapters[name], seed=seed, **options)
    adapters["too-big"] = root / "too-big"
    make_adapter(base, adapters["too-big"], seed=4, rank=2 * MAX_LORA_RANK)
    adapters["dora"] = root / "dora"
    make_adapter(base, adapters["dora"], seed=5, use_dora=True)
    return LoRAModels(root / "base", adapters, references, tokenizer)


def _serve(server_thread: ServerThread, engine: AsyncEngine, env: str | None, **app) -> str:
    """A server over ``engine``, built with ``RUNTIME_LORA_ENV`` set to ``env`` (None: unset)."""
    with pytest.MonkeyPatch.context() as patch:
        if env is None:
            patch.delenv(RUNTIME_LORA_ENV, raising=False)
        else:
            patch.setenv(RUNTIME_LORA_ENV, env)
        return server_thread.serve(lambda: create_app(engine, served_model_name=BASE_NAME, **app))


@pytest.fixture(scope="session")
def lora_servers(lora_models: LoRAModels, server_thread: ServerThread) -> Iterator[LoRAServers]:
    adapters = lora_models.adapters
    config = EngineConfig(
        model=str(lora_models.base),
        dtype="float32",
        kv_cache_memory=8 << 20,
        max_model_len=128,
        lora=LoRAConfig(
            max_loras=2,
            max_lora_rank=MAX_LORA_RANK,
            max_cpu_loras=4,
            modules=(
                LoRAModule("a1", str(adapters["a1"])),
                LoRAModule("a2", str(adapters["a2"]), base_model_name="llama-of-a2"),
            ),
        ),
    )
    engine = AsyncEngine(config)
    yield LoRAServers(
        engine,
        url=_serve(server_thread, engine, "true"),
        keyed_url=_serve(server_thread, engine, "1", api_keys=[API_KEY]),
        plain_url=_serve(server_thread, engine, None),
    )
    engine.shutdown()


@pytest.fixture
def lora_client(lora_servers: LoRAServers) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{lora_servers.url}/v1", api_key="unused", max_retries=0, timeout=60
    )


@pytest.fixture(autouse=True)
def lora_pool_clean(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "lora_servers" in request.fixturenames:
        engine = request.getfixturevalue("lora_servers").engine
        wait_idle(engine)
        engine.check_integrity()
        assert engine.snapshot().kv_blocks_used == 0


def greedy(model: PreTrainedModel, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """``max_tokens`` greedy tokens of ``model`` after ``prompt_ids`` (no stop at EOS)."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt_ids) :]
