"""/metrics under vLLM's names: every name and type docs/api.md lists, labelled ``model_name``,
equal to our own series."""

from __future__ import annotations

import re
from pathlib import Path

import openai

from paged_serve.engine.async_engine import AsyncEngine
from tests.conftest import assert_pool_clean
from tests.server.conftest import http, metric_values, wait_idle

API_DOC = Path(__file__).resolve().parents[3] / "docs" / "api.md"
ROW = re.compile(
    r"^\| `(vllm:[a-z0-9_]+)(?:\{[a-z_]+\})?` \| (gauge|counter|histogram) \| `([^`]+)`"
)


def documented() -> list[tuple[str, str, str]]:
    """(vLLM name, type, our series) rows of docs/api.md's vLLM table, names as on the wire
    (a counter's with ``_total``, as its TYPE line has it in the 0.0.4 format)."""
    rows = []
    for line in API_DOC.read_text().splitlines():
        match = ROW.match(line)
        if match:
            name, kind, ours = match.groups()
            rows.append((name, kind, ours))
    return rows


def test_the_doc_lists_the_figures_routers_read():
    names = {name.removesuffix("_total") for name, _, _ in documented()}
    for needed in (
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
    ):
        assert needed in names


def test_every_documented_name_has_its_type_and_label(base_url: str, model_name: str):
    text = http("GET", f"{base_url}/metrics").body.decode()
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    for name, kind, _ in documented():
        assert types.get(name) == kind, name
    for line in text.splitlines():
        if line.startswith("vllm:"):
            assert f'model_name="{model_name}"' in line, line


def _vllm_series(values: dict[str, float], model_name: str) -> dict[str, float]:
    """The vllm: series with the model_name label taken out, so they can be compared."""
    label = f'model_name="{model_name}"'
    out = {}
    for key, value in values.items():
        if key.startswith("vllm:"):
            plain = key.replace("," + label, "").replace(label + ",", "").replace(label, "")
            out[plain.replace("{}", "")] = value
    return out


def test_vllm_series_equal_ours_after_requests(
    base_url: str, client: openai.OpenAI, model_name: str, engine: AsyncEngine
):
    before = metric_values(base_url)
    prompt = "A shared prefix that the second request finds in the cache: " * 4
    for _ in range(2):
        out = client.completions.create(
            model=model_name,
            prompt=prompt,
            max_tokens=5,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    wait_idle(engine)
    values = metric_values(base_url)
    vllm = _vllm_series(values, model_name)
    for name, kind, ours in documented():
        if name == "vllm:kv_cache_usage_perc":
            continue
        suffixes = {"counter": ["_total"], "gauge": [""], "histogram": ["_sum", "_count"]}[kind]
        base, twin_base = ours.removesuffix("_total"), name.removesuffix("_total")
        for suffix in suffixes:
            mine = {k: v for k, v in values.items() if k.startswith(base + suffix)}
            assert mine, ours
            for key, value in mine.items():
                twin = twin_base + key[len(base) :]
                assert vllm[twin] == value, twin
    assert vllm["vllm:kv_cache_usage_perc"] == 0.0  # idle: no request holds a block
    itl = "vllm:inter_token_latency_seconds_count"
    # One gap per step that produced tokens: 4 per request, less one per accepted draft (the
    # repeated prompt gives prompt lookup something to draft).
    accepted = "vllm:spec_decode_num_accepted_tokens_total"
    saved = vllm[accepted] - before.get(accepted.replace("vllm:", "paged_serve_"), 0)
    assert vllm[itl] - before.get(itl.replace("vllm:", "paged_serve_"), 0) == 2 * 4 - saved
    hits = (
        vllm["vllm:prefix_cache_hits_total"] - before["paged_serve_prefix_cache_hit_tokens_total"]
    )
    assert hits > 0  # the second request hit the first one's blocks
    assert out.usage.completion_tokens == 5
    assert_pool_clean(engine.engine.block_manager)


def test_kv_usage_is_the_used_fraction():
    """Computed from the same scrape's gauges."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import GaugeMetricFamily

    from paged_serve.engine.observe.vllm_names import VllmNames

    class Pool:
        def collect(self):
            for name, value in (("kv_blocks_total", 8), ("kv_blocks_used", 2)):
                yield GaugeMetricFamily("paged_serve_" + name, name, value=value)

    registry = CollectorRegistry()
    registry.register(Pool())
    families = {f.name: f for f in VllmNames(registry, "m").collect()}
    usage = families["vllm:kv_cache_usage_perc"].samples[0]
    assert usage.value == 0.25 and usage.labels == {"model_name": "m"}
