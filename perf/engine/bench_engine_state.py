"""What the dashboard's engine state costs the engine, with and without a watcher.

    python -m perf.engine.bench_engine_state        # the engine-thread costs, no model needed
    python -m perf.engine.bench_engine_state --e2e  # plus steps of the default model here

prints one JSON object:

* ``after_step_unwatched_ns``: the hook the engine thread runs after every step when nobody
  watches (a clock read and a comparison);
* per pool (``pools``): one ``take_state`` (what a watched engine does at most 5 times a
  second), the existing per-step ``BlockManager.usage()`` for scale, the JSON size, the
  interval between takes ``StateWatch`` keeps for that take time, and ``watched_cost_pct``:
  the share of the engine thread's time the takes cost while someone watches;
* with ``--e2e``: mean seconds per step of a fixed greedy workload on the default model, runs
  alternating between no watcher and two watchers polling ``engine_state()`` 4 times a second
  (as two open dashboards do), and how many states were taken.

Timings are medians of repeats; the pools are synthetic (real ``BlockManager`` and
``Scheduler``, no model): the CPU default of the CLI (1 GiB of fp32 KV for SmolLM2) and a pool
the size an H200 gives SmolLM2 in bf16.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import msgspec

from paged_serve.engine.observe.engine_state import (
    MAX_BUSY_FRACTION,
    MIN_INTERVAL_S,
    StateWatch,
    take_state,
)
from paged_serve.engine.sampling_params import SamplingParams
from paged_serve.engine.sched.block_manager import BlockManager
from paged_serve.engine.sched.request import Request, RequestStatus
from paged_serve.engine.sched.scheduler import Scheduler
from perf.wall_timing import median_wall_s

BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class Pool:
    """A synthetic pool: ``running`` requests of ``tokens`` tokens (every other one forked
    into two samples sharing the prompt), ``cached`` cached-free blocks, ``waiting`` queued."""

    name: str
    num_blocks: int
    running: int
    tokens: int
    cached: int
    waiting: int


POOLS = (
    Pool("cpu-default-1GiB", num_blocks=1456, running=24, tokens=256, cached=200, waiting=8),
    Pool("h200-bf16", num_blocks=330_000, running=256, tokens=2048, cached=100_000, waiting=64),
)


def build_engine(pool: Pool) -> SimpleNamespace:
    """What ``take_state`` reads of an LLMEngine, filled as ``pool`` describes."""
    bm = BlockManager(pool.num_blocks, BLOCK_SIZE, enable_prefix_caching=True)
    scheduler = Scheduler(bm, max_num_seqs=1024, max_num_batched_tokens=8192)
    params = SamplingParams(max_tokens=512, temperature=0)
    for i in range(pool.cached // (pool.tokens // BLOCK_SIZE) + 1):  # freed: cached-free blocks
        ids = [i * 7919 + t for t in range(pool.tokens)]
        bm.allocate(f"old-{i}", pool.tokens)
        bm.commit(f"old-{i}", ids, pool.tokens)
        bm.free(f"old-{i}")
    for i in range(pool.running):
        rid = f"req-{i}"
        prompt = [1_000_000 + i * 7919 + t for t in range(pool.tokens - 1)]
        request = Request(rid, prompt, params, seed=0)
        bm.allocate(rid, pool.tokens - 1)
        request.num_computed_tokens = pool.tokens - 1
        request.status = RequestStatus.RUNNING
        scheduler.running.append(request)
        if i % 2:  # a second sample sharing the prompt's blocks
            bm.fork(rid, f"{rid}.1")
            bm.append_slots(f"{rid}.1", pool.tokens)  # copy-on-write of the partial block
            fork = Request(f"{rid}.1", prompt, params, seed=1, index=1)
            fork.num_computed_tokens = pool.tokens - 1
            fork.status = RequestStatus.RUNNING
            scheduler.running.append(fork)
    for i in range(pool.waiting):
        scheduler.add(Request(f"wait-{i}", [5] * 100, params, seed=0))
    bm.check_integrity()
    return SimpleNamespace(block_manager=bm, scheduler=scheduler, num_steps=0)


def measure_pool(pool: Pool) -> dict[str, Any]:
    engine = build_engine(pool)
    bm = engine.block_manager
    repeats = 30 if pool.num_blocks < 10_000 else 7
    take_s = median_wall_s(lambda: take_state(engine, None), repeats)
    usage_s = median_wall_s(bm.usage, repeats)
    state = take_state(engine, None)
    encode_s = median_wall_s(lambda: msgspec.json.encode(state), repeats)
    usage = bm.usage()
    interval_s = max(MIN_INTERVAL_S, take_s / MAX_BUSY_FRACTION)  # StateWatch's rule
    return {
        "pool": pool.name,
        "num_blocks": pool.num_blocks,
        "used_blocks": usage.used_blocks,
        "cached_blocks": usage.cached_blocks,
        "shared_blocks": state.kv.shared_blocks,
        "running": len(state.running),
        "take_state_us": round(take_s * 1e6, 1),
        "usage_per_step_us": round(usage_s * 1e6, 1),
        "json_bytes": len(msgspec.json.encode(state)),
        "json_encode_us": round(encode_s * 1e6, 1),
        "watched_interval_s": round(interval_s, 3),
        "watched_cost_pct": round(100 * take_s / interval_s, 3),
    }


def after_step_unwatched_ns(calls: int = 1_000_000) -> float:
    watch = StateWatch()
    engine = SimpleNamespace()
    start = time.perf_counter()
    for _ in range(calls):
        watch.after_step(engine, None)
    return round((time.perf_counter() - start) / calls * 1e9, 1)


# ---------------------------------------------------------------- end to end (the default model)
def _watch(engine: Any, stop: threading.Event, period_s: float) -> None:
    while not stop.wait(period_s):
        engine.engine_state()


async def _workload(engine: Any, requests: int, max_tokens: int) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)

    async def one(i: int) -> None:
        async for _ in engine.add_request(f"Request {i}: tell me about the sea.", params):
            pass

    await asyncio.gather(*(one(i) for i in range(requests)))


def measure_e2e(rounds: int, requests: int, max_tokens: int) -> dict[str, Any]:
    from paged_serve.engine.async_engine import AsyncEngine
    from paged_serve.engine.config import EngineConfig

    engine = AsyncEngine(EngineConfig(kv_cache_memory=256 << 20, max_model_len=1024))
    asyncio.run(_workload(engine, 2, 4))  # warm-up
    per_step: dict[str, list[float]] = {"unwatched": [], "watched": []}
    takes = 0
    try:
        for _ in range(rounds):
            for mode in ("unwatched", "watched"):
                stop = threading.Event()
                watchers = [
                    threading.Thread(target=_watch, args=(engine, stop, 0.25))
                    for _ in range(2 if mode == "watched" else 0)
                ]
                for w in watchers:
                    w.start()
                taken, steps = engine.state_watch.num_taken, engine.snapshot().num_steps
                start = time.perf_counter()
                asyncio.run(_workload(engine, requests, max_tokens))
                elapsed = time.perf_counter() - start
                stop.set()
                for w in watchers:
                    w.join()
                time.sleep(2.5)  # let the watch window lapse before the next unwatched run
                per_step[mode].append(elapsed / (engine.snapshot().num_steps - steps))
                if mode == "watched":
                    takes += engine.state_watch.num_taken - taken
    finally:
        engine.shutdown()
    out: dict[str, Any] = {"requests": requests, "max_tokens": max_tokens, "rounds": rounds}
    for mode, values in per_step.items():
        out[f"{mode}_step_ms"] = [round(v * 1e3, 2) for v in values]
        out[f"{mode}_median_step_ms"] = round(statistics.median(values) * 1e3, 2)
    out["states_taken_while_watched"] = takes
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--e2e", action="store_true", help="also time the default model")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    report: dict[str, Any] = {
        "after_step_unwatched_ns": after_step_unwatched_ns(),
        "min_interval_s": MIN_INTERVAL_S,
        "max_busy_fraction": MAX_BUSY_FRACTION,
        "pools": [measure_pool(pool) for pool in POOLS],
    }
    if args.e2e:
        report["e2e"] = measure_e2e(args.rounds, args.requests, args.max_tokens)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
