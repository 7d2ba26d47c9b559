"""The operations routes on the wire: ``/health``, the routers' worker routes
(``paged_serve.server.ops.worker_api``) and the dashboard's ``/v1/engine/state``
(``paged_serve.server.ops.dashboard``)."""

from __future__ import annotations

import msgspec

from paged_serve.engine.observe.engine_state import EngineState
from paged_serve.engine.observe.weight_memory import WeightMemory


class HealthStatus(msgspec.Struct):
    status: str = "ok"


class ServerInfo(msgspec.Struct, kw_only=True):
    """SGLang's ``/server_info`` fields a router reads, with vLLM's names beside them."""

    model_path: str
    tokenizer_path: str
    served_model_name: str
    version: str
    dp_size: int = 1
    tp_size: int
    max_total_tokens: int  # tokens the KV cache holds
    max_running_requests: int  # sequences one step batches (--max-num-seqs)
    max_prefill_tokens: int  # tokens one step computes (--max-num-batched-tokens)
    max_model_len: int  # the longest sequence a request may ask for
    page_size: int  # tokens per KV block
    enable_prefix_caching: bool


class ModelInfo(msgspec.Struct, kw_only=True):
    model_path: str
    tokenizer_path: str
    served_model_name: str
    is_generation: bool = True
    model_type: str | None
    architectures: list[str] | None


class LoadInfo(msgspec.Struct, kw_only=True):
    """One data-parallel rank's load (paged-serve runs one)."""

    dp_rank: int = 0
    num_reqs: int  # running plus waiting
    num_waiting_reqs: int
    num_tokens: int  # KV cache in use, in tokens


class FlushResult(msgspec.Struct, kw_only=True):
    message: str
    evicted_blocks: int


class HistoryPoint(msgspec.Struct):
    """One second of the engine's activity (rates over the interval that ends at ``time``)."""

    time: float  # Unix seconds
    generation_tokens_per_s: float
    prompt_tokens_per_s: float
    ttft_s: float | None  # mean time to first token of the requests that finished meanwhile
    requests_running: int
    requests_waiting: int
    kv_blocks_used: int
    preemptions: int  # during the interval


class EngineStateReply(msgspec.Struct):
    """The body of ``GET /v1/engine/state`` (docs/api.md)."""

    model: str
    weights: WeightMemory  # the weights in memory and how the checkpoint stores them
    history_interval_s: float
    engine: EngineState
    history: list[HistoryPoint]
    object: str = "engine.state"
