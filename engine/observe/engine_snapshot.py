"""The engine's gauges for /metrics, taken after every step in O(1) of the pool size.

``take_snapshot`` reads the scheduler's queues and counters, the block pool's counts and the
speculator's drafting counts into one frozen ``EngineSnapshot``; the async engine keeps the
latest one, and ``/metrics`` (engine/observe/metrics.py ``SnapshotCollector``) and the server's
health and load endpoints read it without ever waiting for a step. With LoRA it holds the
adapters of the running and waiting requests (``LoRAFigures``, vLLM's ``lora_requests_info``),
read by the engine thread so that no other thread walks the scheduler's queues.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from paged_serve.engine.observe.lora_figures import LoRAFigures

if TYPE_CHECKING:
    from paged_serve.engine.llm_engine import LLMEngine
    from paged_serve.engine.sched.request import Request
    from paged_serve.engine.spec.speculator import Speculator


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """Gauges for /metrics, read under the engine lock."""

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached: int
    num_preemptions: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_steps: int
    num_graph_steps: int
    # Speculative decoding (engine/spec/speculator.py SpecStats; zeros when it is off)
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    lora: LoRAFigures | None = None  # None without --enable-lora


def spec_counts(speculator: Speculator | None) -> dict:
    """The snapshot's speculative-decoding fields (none when the engine does not speculate)."""
    if speculator is None:
        return {}
    stats = speculator.stats
    return {
        "spec_drafts": stats.num_drafts,
        "spec_draft_tokens": stats.num_draft_tokens,
        "spec_accepted_tokens": stats.num_accepted_tokens,
        "spec_accepted_per_position": tuple(stats.accepted_per_position),
    }


def _by_adapter(requests: Iterable[Request]) -> tuple[tuple[str, int], ...]:
    counts = Counter(r.lora.name for r in requests if r.lora is not None)
    return tuple(sorted(counts.items()))


def lora_figures(engine: LLMEngine) -> LoRAFigures | None:
    """The snapshot's LoRA figures (None without ``--enable-lora``); O(running + waiting)."""
    registry = engine.loras
    if registry is None:
        return None
    scheduler = engine.scheduler
    return LoRAFigures(
        max_loras=registry.config.max_loras,
        running=_by_adapter(scheduler.running),
        waiting=_by_adapter(scheduler.waiting),
        loaded=tuple(a.name for a in registry.slots.loaded()),
        time=time.time(),
    )


def take_snapshot(engine: LLMEngine) -> EngineSnapshot:
    """The gauges now, in O(1) of the pool size (the engine thread takes one after every step)."""
    bm = engine.block_manager
    return EngineSnapshot(
        num_running=engine.num_running,
        num_waiting=engine.num_waiting,
        kv_blocks_total=bm.num_blocks,
        kv_blocks_used=bm.num_used_blocks,
        kv_blocks_cached=bm.num_cached_blocks,
        num_preemptions=engine.scheduler.num_preemptions,
        prefix_query_tokens=engine.scheduler.prefix_query_tokens,
        prefix_hit_tokens=engine.scheduler.prefix_hit_tokens,
        num_steps=engine.num_steps,
        num_graph_steps=engine.num_graph_steps,
        **spec_counts(engine.speculator),
        lora=lora_figures(engine),
    )
