"""The engine's metrics under vLLM's names too, so dashboards and routers built for ``vllm serve``
read a paged-serve ``/metrics`` unchanged.

``VllmNames(registry, model_name)`` is a registry view for ``prometheus_client.generate_latest``:
it yields every family of ``registry`` as it is, then each family ``VLLM_NAMES`` maps again
under its ``vllm:`` name, with the same samples, types and help, plus the label
``model_name`` (vLLM labels every series with the served model name). One source of truth: the
copies are made at scrape time from the very samples of our own families.
``vllm:kv_cache_usage_perc`` has no family of its own: it is ``kv_blocks_used / kv_blocks_total``
of the same scrape (a fraction from 0 to 1, vLLM's meaning: blocks held by running requests;
blocks that sit only in the prefix cache are free to reuse and do not count).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.samples import Sample

from paged_serve.engine.observe.metrics import PREFIX

VLLM_PREFIX = "vllm:"
# Our family name without PREFIX -> vLLM's family name without VLLM_PREFIX (on the wire a
# counter family gains "_total", a histogram "_bucket", "_sum" and "_count", as ours do).
VLLM_NAMES = {
    "requests_running": "num_requests_running",
    "requests_waiting": "num_requests_waiting",
    "prefix_cache_query_tokens": "prefix_cache_queries",
    "prefix_cache_hit_tokens": "prefix_cache_hits",
    "preemptions": "num_preemptions",
    "prompt_tokens": "prompt_tokens",
    "generation_tokens": "generation_tokens",
    "request_success": "request_success",
    "time_to_first_token_seconds": "time_to_first_token_seconds",
    "inter_token_latency_seconds": "inter_token_latency_seconds",
    "time_per_output_token_seconds": "request_time_per_output_token_seconds",
    "e2e_request_latency_seconds": "e2e_request_latency_seconds",
    "request_queue_time_seconds": "request_queue_time_seconds",
    "request_prompt_tokens": "request_prompt_tokens",
    "request_generation_tokens": "request_generation_tokens",
    "spec_decode_num_drafts": "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens": "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens": "spec_decode_num_accepted_tokens",
    "spec_decode_num_accepted_tokens_per_pos": "spec_decode_num_accepted_tokens_per_pos",
    "lora_requests_info": "lora_requests_info",
}
KV_USAGE = VLLM_PREFIX + "kv_cache_usage_perc"


class VllmNames:
    """``registry``'s families, then the vLLM copies labelled ``model_name``."""

    def __init__(self, registry: CollectorRegistry, model_name: str):
        self._registry = registry
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        ours = list(self._registry.collect())
        yield from ours
        gauges: dict[str, float] = {}
        for family in ours:
            short = family.name.removeprefix(PREFIX)
            if family.type == "gauge" and family.samples:
                gauges[short] = family.samples[0].value
            target = VLLM_NAMES.get(short)
            if target is not None and family.name.startswith(PREFIX):
                yield self._copy(family, VLLM_PREFIX + target)
        total = gauges.get("kv_blocks_total")
        if total is not None and "kv_blocks_used" in gauges:
            usage = GaugeMetricFamily(
                KV_USAGE,
                "Fraction of KV cache blocks held by live requests (0 to 1).",
                labels=["model_name"],
            )
            usage.add_metric([self._model_name], gauges["kv_blocks_used"] / total if total else 0.0)
            yield usage

    def _copy(self, family: Metric, name: str) -> Metric:
        """``family`` renamed to ``name``, each sample labelled with the model name."""
        copy = Metric(name, family.documentation, family.type)
        for s in family.samples:
            labels = {**s.labels, "model_name": self._model_name}
            sample_name = name + s.name[len(family.name) :]
            copy.samples.append(Sample(sample_name, labels, s.value, s.timestamp, s.exemplar))
        return copy
