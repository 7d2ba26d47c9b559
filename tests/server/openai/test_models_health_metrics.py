"""GET /v1/models, /health and /metrics."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest

from paged_serve.engine.async_engine import AsyncEngine
from paged_serve.engine.observe.metrics import histogram_sum_count
from paged_serve.engine.sampling_params import SamplingParams
from paged_serve.server.app import create_app
from tests.server.conftest import (
    MAX_MODEL_LEN,
    ServerThread,
    assert_error,
    http,
    metric_values,
    wait_idle,
)

HF_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"  # a Hugging Face id: served names may have "/"

GAUGES = [
    "paged_serve_requests_running",
    "paged_serve_requests_waiting",
    "paged_serve_kv_blocks_total",
    "paged_serve_kv_blocks_used",
    "paged_serve_kv_blocks_cached",
]
COUNTERS = [
    "paged_serve_prefix_cache_hit_tokens_total",
    "paged_serve_prefix_cache_query_tokens_total",
    "paged_serve_preemptions_total",
    "paged_serve_steps_total",
    "paged_serve_decode_graph_steps_total",
    "paged_serve_generation_tokens_total",
    "paged_serve_prompt_tokens_total",
]
HISTOGRAMS = [
    "paged_serve_time_to_first_token_seconds",
    "paged_serve_time_per_output_token_seconds",
    "paged_serve_e2e_request_latency_seconds",
    "paged_serve_request_queue_time_seconds",
]
FINISHED = "paged_serve_request_success_total"
FINISH_REASONS = ("stop", "length", "abort", "error")


def test_models_list_and_retrieve(client: openai.OpenAI, model_name: str):
    models = client.models.list()
    assert [m.id for m in models.data] == [model_name]
    [model] = models.data
    assert model.object == "model"
    assert model.owned_by == "paged-serve"
    assert isinstance(model.created, int) and model.created > 0
    assert client.models.retrieve(model_name).id == model_name
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.body["code"] == "model_not_found"


def test_models_raw_shape(base_url: str, model_name: str):
    body = http("GET", f"{base_url}/v1/models").json()
    assert body["object"] == "list"
    assert body["data"][0]["id"] == model_name
    assert body["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert body["data"][0]["quantization"] is None  # the tiny model is stored unquantized


@pytest.fixture(scope="module")
def hf_named_url(engine: AsyncEngine, server_thread: ServerThread) -> str:
    return server_thread.serve(lambda: create_app(engine, served_model_name=HF_NAME))


@pytest.mark.parametrize(
    "name", [HF_NAME, HF_NAME.replace("/", "%2F"), HF_NAME.replace("/", "%2f")]
)
def test_a_served_name_with_a_slash_is_found(hf_named_url: str, name: str):
    reply = http("GET", f"{hf_named_url}/v1/models/{name}")
    assert reply.status == 200, reply.body
    assert reply.json()["id"] == HF_NAME
    client = openai.OpenAI(base_url=f"{hf_named_url}/v1", api_key="unused", max_retries=0)
    assert client.models.retrieve(HF_NAME).id == HF_NAME


@pytest.mark.parametrize("name", ["HuggingFaceTB/other", "HuggingFaceTB", f"{HF_NAME}/extra"])
def test_another_name_with_a_slash_is_model_not_found(hf_named_url: str, name: str):
    reply = http("GET", f"{hf_named_url}/v1/models/{name}")
    assert_error(reply, 404, param="model", code="model_not_found")


def test_health(base_url: str, engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch):
    reply = http("GET", f"{base_url}/health")
    assert reply.status == 200
    assert reply.json() == {"status": "ok"}
    monkeypatch.setattr(AsyncEngine, "is_alive", property(lambda self: False))
    assert_error(http("GET", f"{base_url}/health"), 503, code="engine_dead")


def test_metrics_format_and_names(base_url: str):
    reply = http("GET", f"{base_url}/metrics")
    assert reply.status == 200
    assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    text = reply.body.decode()
    for name, kind in (
        [(g, "gauge") for g in GAUGES]
        + [(c, "counter") for c in COUNTERS]
        + [(h, "histogram") for h in HISTOGRAMS]
        + [(FINISHED, "counter")]
    ):
        assert f"# HELP {name} " in text
        assert f"# TYPE {name} {kind}\n" in text
    values = metric_values(base_url)
    for name in GAUGES + COUNTERS:
        assert name in values
    for name in HISTOGRAMS:
        assert f'{name}_bucket{{le="+Inf"}}' in values
        assert values[f'{name}_bucket{{le="+Inf"}}'] == values[f"{name}_count"]
        assert f"{name}_sum" in values
    for reason in FINISH_REASONS:  # every reason's series exists, 0 or more
        assert f'{FINISHED}{{finished_reason="{reason}"}}' in values
    assert values["paged_serve_kv_blocks_total"] > 0
    assert values["paged_serve_kv_blocks_used"] == 0  # idle


def test_metrics_count_a_request(base_url: str, client: openai.OpenAI, model_name: str):
    before = metric_values(base_url)
    out = client.completions.create(
        model=model_name,
        prompt="Counting tokens:",
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    after = metric_values(base_url)
    assert out.usage.completion_tokens == 4
    generated = "paged_serve_generation_tokens_total"
    assert after[generated] - before[generated] == 4
    prompt = "paged_serve_prompt_tokens_total"
    assert after[prompt] - before[prompt] == out.usage.prompt_tokens
    ttft = "paged_serve_time_to_first_token_seconds_count"
    assert after[ttft] - before[ttft] == 1
    tpot = "paged_serve_time_per_output_token_seconds_count"
    assert after[tpot] - before[tpot] == 1
    assert after["paged_serve_kv_blocks_used"] == 0
    steps = "paged_serve_steps_total"
    assert after[steps] - before[steps] >= 4  # a prefill, then a decode step per later token
    graph_steps = "paged_serve_decode_graph_steps_total"
    assert after[graph_steps] == before[graph_steps] == 0  # no CUDA: every step is eager
    query = "paged_serve_prefix_cache_query_tokens_total"
    assert 0 < after[query] - before[query] <= out.usage.prompt_tokens
    length = f'{FINISHED}{{finished_reason="length"}}'
    assert after[length] - before[length] == 1
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds"):
        count, total = f"paged_serve_{name}_count", f"paged_serve_{name}_sum"
        assert after[count] - before[count] == 1
        assert after[total] >= before[total]


def test_metrics_latencies_are_consistent(engine: AsyncEngine):
    """For one request the queue time is below its TTFT, which is below its e2e latency."""
    stats = engine.stats

    def sums() -> list[float]:
        return [
            histogram_sum_count(h)[0] for h in (stats.queue_time, stats.ttft, stats.e2e_latency)
        ]

    async def run() -> None:
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        async for _ in engine.add_request("Timing one request", params):
            pass

    before = sums()
    asyncio.run(run())
    queue, ttft, e2e = (b - a for a, b in zip(before, sums()))
    assert 0 <= queue <= ttft <= e2e


def test_an_abort_counts_as_finished_for_abort(base_url: str, engine: AsyncEngine):
    """A client that hangs up mid-stream: its request counts under finished_reason="abort"."""
    label = f'{FINISHED}{{finished_reason="abort"}}'
    before = metric_values(base_url)[label]

    async def hang_up() -> None:
        body = {
            "prompt": "Count to a thousand:",
            "max_tokens": 200,
            "stream": True,
            "ignore_eos": True,
        }
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{base_url}/v1/completions", json=body) as resp:
                await resp.content.readline()  # the first frame: it is running

    asyncio.run(hang_up())
    wait_idle(engine)
    assert metric_values(base_url)[label] - before == 1
