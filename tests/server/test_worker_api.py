"""The routes routers call on a worker: /health_generate, /server_info, /model_info, /get_load,
/flush_cache and /reset_prefix_cache (server/worker_api.py)."""

from __future__ import annotations

import openai
import pytest

from paged_serve.engine.async_engine import AsyncEngine
from tests.server.conftest import API_KEYS, assert_error, http, metric_values, wait_idle

PROMPT = "The quick brown fox jumps over the lazy dog. " * 12  # several full KV blocks
CACHED = "paged_serve_kv_blocks_cached"


def _cached_tokens(client: openai.OpenAI, model: str) -> int:
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0)
    return reply.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("path", ["/server_info", "/get_server_info"])
def test_server_info_gives_the_serving_limits(path: str, base_url: str, engine: AsyncEngine):
    info = http("GET", f"{base_url}{path}").json()
    config = engine.config
    assert info["served_model_name"] == engine.model_name
    assert info["model_path"] == info["tokenizer_path"] == engine.model_name  # the default model
    assert info["dp_size"] == 1 and info["tp_size"] == 1
    assert info["max_total_tokens"] == engine.snapshot().kv_blocks_total * engine.block_size
    assert info["max_running_requests"] == config.max_num_seqs
    assert info["max_prefill_tokens"] == config.max_num_batched_tokens
    assert info["page_size"] == engine.block_size == 16
    assert info["enable_prefix_caching"] is True
    assert isinstance(info["version"], str) and info["version"]


@pytest.mark.parametrize("path", ["/model_info", "/get_model_info"])
def test_model_info_names_the_model(path: str, base_url: str, engine: AsyncEngine):
    info = http("GET", f"{base_url}{path}").json()
    assert info["is_generation"] is True
    assert info["model_type"] == engine.model_config.model_type == "llama"
    assert info["architectures"] == ["LlamaForCausalLM"]
    assert info["served_model_name"] == info["model_path"] == engine.model_name


def test_get_load_counts_live_requests_and_their_kv_tokens(
    base_url: str, client: openai.OpenAI, model_name: str
):
    assert http("GET", f"{base_url}/get_load").json() == [
        {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
    ]
    stream = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=200, stream=True, temperature=0
    )
    try:
        next(iter(stream))  # the request has been prefilled
        [load] = http("GET", f"{base_url}/get_load").json()
        assert load["dp_rank"] == 0 and load["num_reqs"] == 1
        assert load["num_waiting_reqs"] == 0
        assert load["num_tokens"] >= 16 * 6  # its prompt's blocks at least
        assert load["num_tokens"] % 16 == 0
    finally:
        stream.close()


def test_health_generate_runs_one_token(base_url: str, engine: AsyncEngine):
    before = engine.stats.generation_tokens_total
    reply = http("GET", f"{base_url}/health_generate")
    assert reply.status == 200 and reply.body == b""
    assert engine.stats.generation_tokens_total == before + 1


def test_flush_cache_evicts_prefixes_and_refuses_while_busy(
    base_url: str, client: openai.OpenAI, model_name: str, engine: AsyncEngine
):
    _cached_tokens(client, model_name)
    assert _cached_tokens(client, model_name) > 0  # the prompt's blocks were cached
    wait_idle(engine)
    cached = metric_values(base_url)[CACHED]
    assert cached > 0

    stream = client.completions.create(
        model=model_name, prompt="Count to fifty:", max_tokens=200, stream=True
    )
    try:
        next(iter(stream))
        assert_error(http("POST", f"{base_url}/flush_cache"), 400, code="server_busy")
    finally:
        stream.close()
    wait_idle(engine)
    assert _cached_tokens(client, model_name) > 0  # nothing was evicted

    wait_idle(engine)
    with engine.between_steps() as idle:
        cached_now = idle.block_manager.num_cached_blocks  # what the flush must evict
    assert cached_now > 0
    reply = http("POST", f"{base_url}/flush_cache")
    assert reply.status == 200
    body = reply.json()
    assert body == {"message": "Cache flushed.", "evicted_blocks": cached_now}
    assert metric_values(base_url)[CACHED] == 0
    assert _cached_tokens(client, model_name) == 0  # computed again
    wait_idle(engine)
    assert http("POST", f"{base_url}/reset_prefix_cache").json()["evicted_blocks"] > 0
    assert _cached_tokens(client, model_name) == 0


def test_cache_routes_need_the_key_and_info_routes_do_not(keyed_url: str):
    assert_error(http("POST", f"{keyed_url}/flush_cache"), 401, code="invalid_api_key")
    assert_error(http("POST", f"{keyed_url}/reset_prefix_cache"), 401, code="invalid_api_key")
    keyed = {"Authorization": f"Bearer {API_KEYS[1]}"}
    assert http("POST", f"{keyed_url}/flush_cache", headers=keyed).status == 200
    for path in ("/server_info", "/model_info", "/get_load", "/health_generate"):
        assert http("GET", f"{keyed_url}{path}").status == 200, path


def test_flush_cache_is_post_only(base_url: str):
    assert_error(http("GET", f"{base_url}/flush_cache"), 405)
