"""``/metrics`` carries vLLM's ``vllm:lora_requests_info`` (the adapters of the running and
waiting requests, the slots, the sample's time as its value), and the dashboard's engine state
the adapters in slots and each request's adapter."""

from __future__ import annotations

import time

import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import http
from tests.server.lora.conftest import LoRAServers

PROMPT = [7, 30, 41, 52, 63]


def _lora_info(url: str) -> dict[str, object]:
    text = http("GET", f"{url}/metrics").body.decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    (sample,) = families["vllm:lora_requests_info"].samples
    return {**sample.labels, "value": sample.value}


def test_metrics_name_the_adapters_of_live_requests(
    lora_client: openai.OpenAI, lora_servers: LoRAServers
) -> None:
    url = lora_servers.url
    before = time.time()
    idle = _lora_info(url)
    assert idle["running_lora_adapters"] == idle["waiting_lora_adapters"] == ""
    assert idle["max_lora"] == "2"
    streams = [
        lora_client.completions.create(
            model=name,
            prompt=PROMPT,
            max_tokens=60,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for name in ("a2", "a1")
    ]
    for stream in streams:
        next(iter(stream))  # both admitted: each has its first token
    busy = _lora_info(url)
    assert busy["running_lora_adapters"] == "a1,a2"
    assert busy["value"] >= before - 1.0  # Unix seconds of the snapshot, as vLLM's
    state = http("GET", f"{url}/v1/engine/state").json()
    lora = state["engine"]["gauges"]["lora"]
    assert lora["max_loras"] == 2 and sorted(lora["loaded"]) == ["a1", "a2"]
    assert sorted(r["lora"] for r in state["engine"]["running"]) == ["a1", "a2"]
    for stream in streams:
        assert sum(1 for _ in stream) > 0
