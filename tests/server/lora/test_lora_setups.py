"""Servers set up other ways: without ``--enable-lora`` the load endpoint is a 400 saying so and
an adapter's name is an unknown model; an adapter may not take a served model name; the
command line refuses a ``--lora-modules`` adapter it cannot serve before serving anything."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from paged_serve.engine.async_engine import AsyncEngine
from paged_serve.engine.config import EngineConfig
from paged_serve.engine.lora.config import LoRAConfig, LoRAModule
from paged_serve.server.app import create_app
from paged_serve.server.cli import main
from tests.server.conftest import ServerThread, assert_error, http, wait_idle
from tests.server.lora.conftest import BASE_NAME, LoRAModels


@pytest.fixture(scope="module")
def base_engine(lora_models: LoRAModels) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(
        EngineConfig(model=str(lora_models.base), dtype="float32", kv_cache_memory=4 << 20)
    )
    yield engine
    wait_idle(engine)
    engine.check_integrity()
    engine.shutdown()


def test_without_enable_lora(
    base_engine: AsyncEngine, lora_models: LoRAModels, server_thread: ServerThread
) -> None:
    url = server_thread.serve(
        lambda: create_app(base_engine, served_model_name=BASE_NAME, runtime_lora_updating=True)
    )
    body = {"lora_name": "a1", "lora_path": str(lora_models.adapters["a1"])}
    reply = http("POST", f"{url}/v1/load_lora_adapter", json=body)
    error = assert_error(reply, 400, param="lora_name")
    assert "--enable-lora" in error["message"]
    cards = http("GET", f"{url}/v1/models").json()["data"]
    assert [(c["id"], c["root"], c["parent"]) for c in cards] == [
        (BASE_NAME, str(lora_models.base), None)
    ]
    reply = http("POST", f"{url}/v1/completions", json={"model": "a1", "prompt": [7, 8]})
    assert_error(reply, 404, param="model", code="model_not_found")


def test_an_adapter_may_not_take_a_served_model_name(lora_models: LoRAModels) -> None:
    lora = LoRAConfig(modules=(LoRAModule("alias", str(lora_models.adapters["a1"])),))
    engine = AsyncEngine(
        EngineConfig(
            model=str(lora_models.base), dtype="float32", kv_cache_memory=4 << 20, lora=lora
        )
    )
    try:
        with pytest.raises(ValueError, match=r"\['alias'\] are served model names too"):
            create_app(engine, served_model_name=[BASE_NAME, "alias"])
    finally:
        engine.shutdown()


def test_the_cli_refuses_an_adapter_it_cannot_serve(
    lora_models: LoRAModels, caplog: pytest.LogCaptureFixture
) -> None:
    argv = [
        str(lora_models.base),
        "--kv-cache-memory", str(4 << 20),
        "--enable-lora",
        "--lora-modules", f"big={lora_models.adapters['too-big']}",
    ]  # fmt: skip
    with caplog.at_level(logging.ERROR):
        assert main(argv) == 2
    assert "rank 32 is above --max-lora-rank 16" in caplog.text
