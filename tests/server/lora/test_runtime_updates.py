"""``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` set: an adapter loaded is served by name, unloaded its name
404s, and a request streaming on it when it is unloaded finishes on it; refused adapters are
400s that say why; the routes need the API key, and do not exist without the variable."""

from __future__ import annotations

import asyncio

import openai
import pytest

from paged_serve.engine.sampling_params import SamplingParams
from paged_serve.server.app import create_app
from paged_serve.server.generation.run import Job, start_generation
from paged_serve.server.protocol.errors import APIError
from paged_serve.server.state import STATE
from tests.server.conftest import assert_error, http
from tests.server.lora.conftest import API_KEY, BASE_NAME, LoRAModels, LoRAServers, greedy

PROMPT = [7, 30, 41, 52, 63]
IDS = {"ignore_eos": True, "return_token_ids": True}
LONG = 120  # tokens: a stream still running when its adapter is unloaded


def load(url: str, name: str, path: object, headers: dict[str, str] | None = None):
    body = {"lora_name": name, "lora_path": str(path)}
    return http("POST", f"{url}/v1/load_lora_adapter", json=body, headers=headers)


def unload(url: str, name: str, headers: dict[str, str] | None = None):
    body = {"lora_name": name}
    return http("POST", f"{url}/v1/unload_lora_adapter", json=body, headers=headers)


def served(url: str) -> list[str]:
    return [card["id"] for card in http("GET", f"{url}/v1/models").json()["data"]]


def test_load_use_unload(
    lora_client: openai.OpenAI, lora_models: LoRAModels, lora_servers: LoRAServers
) -> None:
    url = lora_servers.url
    reply = load(url, "a3", lora_models.adapters["a3"])
    assert reply.status == 200, reply.body
    assert reply.body.decode() == "Success: LoRA adapter 'a3' added successfully."
    try:
        assert served(url) == [BASE_NAME, "a1", "a2", "a3"]
        out = lora_client.completions.create(
            model="a3", prompt=PROMPT, max_tokens=8, temperature=0, extra_body=IDS
        )
        assert out.model == "a3"
        assert out.choices[0].model_extra["token_ids"] == greedy(
            lora_models.references["a3"], PROMPT, 8
        )
    finally:
        reply = unload(url, "a3")
    assert reply.status == 200, reply.body
    assert reply.body.decode() == "Success: LoRA adapter 'a3' removed successfully."
    assert served(url) == [BASE_NAME, "a1", "a2"]
    with pytest.raises(openai.NotFoundError):
        lora_client.completions.create(model="a3", prompt=PROMPT, max_tokens=2)
    assert_error(unload(url, "a3"), 404, param="lora_name", code="lora_adapter_not_found")


def test_a_stream_on_an_unloaded_adapter_finishes_on_it(
    lora_client: openai.OpenAI, lora_models: LoRAModels, lora_servers: LoRAServers
) -> None:
    url, engine = lora_servers.url, lora_servers.engine
    assert load(url, "a3", lora_models.adapters["a3"]).status == 200
    stream = lora_client.completions.create(
        model="a3", prompt=PROMPT, max_tokens=LONG, temperature=0, stream=True, extra_body=IDS
    )
    chunks = iter(stream)
    ids = list(next(chunks).choices[0].model_extra["token_ids"])
    assert unload(url, "a3").status == 200
    with engine.between_steps() as llm:  # the request outlived its adapter's name
        on_a3 = [r for r in llm.scheduler.running if r.lora is not None and r.lora.name == "a3"]
    assert len(on_a3) == 1, "the stream finished before the unload: make LONG longer"
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            ids += choice.model_extra.get("token_ids") or []
            finish = choice.finish_reason or finish
    assert finish == "length"
    assert ids == greedy(lora_models.references["a3"], PROMPT, LONG)
    assert served(url) == [BASE_NAME, "a1", "a2"]


@pytest.mark.parametrize(
    ("adapter", "reason"),
    [
        ("too-big", "rank 32 is above --max-lora-rank 16"),
        ("dora", "DoRA adapters are not served"),
        ("missing", "no adapter_config.json"),
    ],
)
def test_refused_adapters_are_400_with_the_reason(
    lora_models: LoRAModels, lora_servers: LoRAServers, adapter: str, reason: str
) -> None:
    path = lora_models.adapters.get(adapter, lora_models.base.parent / "missing")
    error = assert_error(load(lora_servers.url, "refused", path), 400, param="lora_path")
    assert reason in error["message"]
    assert served(lora_servers.url) == [BASE_NAME, "a1", "a2"]


def test_names_already_served_are_400(lora_models: LoRAModels, lora_servers: LoRAServers) -> None:
    for name in ("a1", BASE_NAME):
        error = assert_error(
            load(lora_servers.url, name, lora_models.adapters["a3"]), 400, param="lora_name"
        )
        assert f"{name!r} is already served" in error["message"]
    assert_error(load(lora_servers.url, "", lora_models.adapters["a3"]), 400, param="lora_name")
    reply = http("POST", f"{lora_servers.url}/v1/load_lora_adapter", json={"lora_name": "x"})
    assert_error(reply, 400, param="lora_path")
    assert served(lora_servers.url) == [BASE_NAME, "a1", "a2"]


def test_routes_need_the_api_key(lora_models: LoRAModels, lora_servers: LoRAServers) -> None:
    url, path = lora_servers.keyed_url, lora_models.adapters["a3"]
    assert_error(load(url, "a3", path), 401, code="invalid_api_key")
    assert_error(unload(url, "a1"), 401, code="invalid_api_key")
    wrong = {"Authorization": "Bearer sk-wrong"}
    assert_error(load(url, "a3", path, wrong), 401, code="invalid_api_key")
    assert served(lora_servers.url) == [BASE_NAME, "a1", "a2"]
    key = {"Authorization": f"Bearer {API_KEY}"}
    assert load(url, "a3", path, key).status == 200
    assert unload(url, "a3", key).status == 200


def test_routes_absent_without_the_environment_variable(
    lora_models: LoRAModels, lora_servers: LoRAServers
) -> None:
    url = lora_servers.plain_url
    assert_error(load(url, "a3", lora_models.adapters["a3"]), 404)
    assert_error(unload(url, "a1"), 404)
    assert served(url) == [BASE_NAME, "a1", "a2"]


def test_a_request_whose_adapter_left_after_its_check_is_404_not_the_base(
    lora_models: LoRAModels, lora_servers: LoRAServers
) -> None:
    """Unloaded between ``check_model`` and the engine: a 404 wherever the name is next
    resolved, never a run on the base model."""
    state = create_app(lora_servers.engine, served_model_name=BASE_NAME)[STATE]
    assert load(lora_servers.url, "a3", lora_models.adapters["a3"]).status == 200
    state.check_model("a3")
    assert (state.lora_for("a3"), state.reply_model("a3")) == ("a3", "a3")
    assert (state.lora_for(BASE_NAME), state.reply_model(None)) == (None, BASE_NAME)
    assert unload(lora_servers.url, "a3").status == 200
    with pytest.raises(APIError) as info:
        state.lora_for("a3")
    assert (info.value.status, info.value.param) == (404, "model")

    async def start() -> None:  # the name resolved before the unload reaches the engine
        job = Job(0, PROMPT, SamplingParams(max_tokens=2))
        start_generation(state, "race", [job], "prompt", cache_salt=None, lora="a3")

    with pytest.raises(APIError) as info:
        asyncio.run(start())
    assert (info.value.status, info.value.code) == (404, "model_not_found")
