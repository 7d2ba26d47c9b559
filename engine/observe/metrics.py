"""Engine metrics on ``prometheus_client``, in one ``CollectorRegistry`` per engine.

Two kinds of figures, kept the way each is cheapest to keep:

* **Observations** (latency and size histograms, finished requests by reason) are
  prometheus_client metric objects, observed by the engine thread once per finished request,
  and for the inter-token latency once per step that gave a request tokens after its first
  (vLLM's: a speculative step's several tokens are one gap; an observe is
  a lock and a bucket search: 2.6 us timed with ``timeit`` on the 2-core CI box, against decode
  steps of tens of milliseconds there).
* **Running totals** the engine thread bumps per token or per step (prompt and generated
  tokens here; the scheduler's and block pool's gauges and counters) stay plain integers and
  are read at scrape time by a collector (``TotalsCollector`` here, ``SnapshotCollector`` for the
  async engine's per-step snapshot), so the hot path takes no lock.

Every engine has its own registry, never prometheus_client's global one: a process (a test
session, above all) builds many engines, and each must report its own figures. The server's
``/metrics`` renders ``EngineStats.registry``.

Names (all under ``paged_serve_``; the contract list is in DESIGN.md): the TTFT and TPOT
histograms, and, with vLLM's meaning, ``inter_token_latency_seconds`` (each gap between two
steps that gave a request tokens), ``e2e_request_latency_seconds``, ``request_queue_time_seconds``
(arrival to first admission into the running batch), ``request_prompt_tokens`` and
``request_generation_tokens`` (per finished request) and
``request_success_total{finished_reason}``, and speculative decoding's
``spec_decode_num_drafts``, ``_num_draft_tokens``, ``_num_accepted_tokens`` and
``_num_accepted_tokens_per_pos{position}`` counters, and with LoRA vLLM's
``lora_requests_info`` gauge. ``paged_serve.engine.observe.vllm_names``
repeats them under vLLM's own names for the server's ``/metrics``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from paged_serve.engine.observe.lora_figures import LoRAFigures
from paged_serve.engine.outputs import RequestMetrics

PREFIX = "paged_serve_"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# vLLM's request-latency buckets, for its e2e latency and queue time histograms
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
# vLLM's token-count buckets (1, 2, 5 per decade), for the per-request token histograms
TOKEN_COUNT_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))
FINISH_REASONS = ("stop", "length", "abort", "error")


class EngineStats:
    """The engine's metrics since start.

    ``prompt_tokens_total`` and ``generation_tokens_total`` are plain integers the engine
    thread adds to; everything else is observed by ``observe_finished``.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Seconds from arrival to the first output token.",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Mean seconds between output tokens after the first, per request.",
            buckets=TPOT_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Seconds between two consecutive output tokens of a request.",
            buckets=TPOT_BUCKETS,
            registry=self.registry,
        )
        self.request_prompt_tokens = Histogram(
            PREFIX + "request_prompt_tokens",
            "Prompt tokens per finished request.",
            buckets=TOKEN_COUNT_BUCKETS,
            registry=self.registry,
        )
        self.request_generation_tokens = Histogram(
            PREFIX + "request_generation_tokens",
            "Output tokens per finished request (each of n samples counts).",
            buckets=TOKEN_COUNT_BUCKETS,
            registry=self.registry,
        )
        self.e2e_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Seconds from arrival to the last output, per finished request.",
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.queue_time = Histogram(
            PREFIX + "request_queue_time_seconds",
            "Seconds from arrival to first admission into the running batch.",
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.finished = Counter(
            PREFIX + "request_success",
            "Finished requests (each of n samples counts), by finish reason.",
            ["finished_reason"],
            registry=self.registry,
        )
        for reason in FINISH_REASONS:  # every series exists from the start, at 0
            self.finished.labels(reason)
        self.registry.register(TotalsCollector(self))

    def observe_finished(
        self, metrics: RequestMetrics, finish_reason: str, *, first_token: bool
    ) -> None:
        """Count a finished request; its TTFT only if it produced a token, its TPOT only if it
        produced two or more, its queue time only if it was ever admitted."""
        self.finished.labels(finish_reason).inc()
        self.e2e_latency.observe(metrics.e2e_latency)
        self.request_prompt_tokens.observe(metrics.num_prompt_tokens)
        self.request_generation_tokens.observe(metrics.num_output_tokens)
        if metrics.queue_time is not None:
            self.queue_time.observe(metrics.queue_time)
        if first_token:
            self.ttft.observe(metrics.ttft)
        if metrics.num_output_tokens > 1:
            self.tpot.observe(metrics.tpot)


def histogram_sum_count(histogram: Histogram) -> tuple[float, int]:
    """A histogram's (sum, count) so far, read through the collector API."""
    total, count = 0.0, 0
    for sample in histogram.collect()[0].samples:
        if sample.name.endswith("_sum"):
            total = sample.value
        elif sample.name.endswith("_count"):
            count = int(sample.value)
    return total, count


class TotalsCollector(Collector):
    """The token totals the engine thread keeps as plain integers, as counters."""

    def __init__(self, stats: EngineStats):
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats
        yield CounterMetricFamily(
            PREFIX + "generation_tokens", "Tokens generated.", value=stats.generation_tokens_total
        )
        yield CounterMetricFamily(
            PREFIX + "prompt_tokens", "Prompt tokens received.", value=stats.prompt_tokens_total
        )


# (name without the prefix, kind, help, snapshot field)
SNAPSHOT_METRICS = (
    ("requests_running", "gauge", "Requests in the running batch.", "num_running"),
    ("requests_waiting", "gauge", "Requests waiting to be scheduled.", "num_waiting"),
    ("kv_blocks_total", "gauge", "KV cache blocks in the pool.", "kv_blocks_total"),
    ("kv_blocks_used", "gauge", "KV cache blocks held by live requests.", "kv_blocks_used"),
    (
        "kv_blocks_cached",
        "gauge",
        "KV cache blocks held only by the prefix cache (reusable, evictable).",
        "kv_blocks_cached",
    ),
    (
        "prefix_cache_hit_tokens",
        "counter",
        "Prompt tokens served from the prefix cache.",
        "prefix_hit_tokens",
    ),
    (
        "prefix_cache_query_tokens",
        "counter",
        "Prompt tokens looked up in the prefix cache.",
        "prefix_query_tokens",
    ),
    ("preemptions", "counter", "Requests preempted to free KV blocks.", "num_preemptions"),
    ("steps", "counter", "Engine steps (batches run through the model).", "num_steps"),
    (
        "decode_graph_steps",
        "counter",
        "Engine steps that replayed a captured decode CUDA graph.",
        "num_graph_steps",
    ),
    (
        "spec_decode_num_drafts",
        "counter",
        "Sequence-steps that verified a speculative draft.",
        "spec_drafts",
    ),
    (
        "spec_decode_num_draft_tokens",
        "counter",
        "Tokens drafted for speculative decoding.",
        "spec_draft_tokens",
    ),
    (
        "spec_decode_num_accepted_tokens",
        "counter",
        "Drafted tokens the target model's own draw confirmed.",
        "spec_accepted_tokens",
    ),
)
ACCEPTED_PER_POSITION = "spec_decode_num_accepted_tokens_per_pos"
LORA_REQUESTS_INFO = "lora_requests_info"


class SnapshotCollector(Collector):
    """The gauges and counters of the engine's per-step snapshot (``snapshot`` returns an
    object with the fields ``SNAPSHOT_METRICS`` names), read once per scrape. Counters get
    the ``_total`` suffix on the wire."""

    def __init__(self, snapshot: Callable[[], Any]):
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        for name, kind, help_text, field in SNAPSHOT_METRICS:
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            yield family(PREFIX + name, help_text, value=getattr(snap, field))
        per_position = CounterMetricFamily(
            PREFIX + ACCEPTED_PER_POSITION,
            "Accepted drafted tokens by their position in the draft (0 = the first).",
            labels=["position"],
        )
        for position, count in enumerate(snap.spec_accepted_per_position):
            per_position.add_metric([str(position)], count)
        yield per_position
        if snap.lora is not None:
            yield lora_requests_info(snap.lora)


def lora_requests_info(figures: LoRAFigures) -> GaugeMetricFamily:
    """vLLM's ``lora_requests_info``: one sample whose labels name the adapters of the running
    and waiting requests (comma-separated, sorted; empty when none) and the device slots
    (``max_lora``); its value is when the figures were taken (Unix seconds), as vLLM's."""
    info = GaugeMetricFamily(
        PREFIX + LORA_REQUESTS_INFO,
        "LoRA adapters of the running and waiting requests; the value is the sample's time.",
        labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
    )
    running = ",".join(name for name, _ in figures.running)
    waiting = ",".join(name for name, _ in figures.waiting)
    info.add_metric([running, waiting, str(figures.max_loras)], figures.time)
    return info
