"""Prefix caching and n > 1 sharing, measured on the engine (the default model, CPU by default).

    python -m perf.engine.bench_prefix [--requests 32] [--system-tokens 512] [--question-tokens 32]

1. A shared-prefix workload: ``--requests`` requests share one ``--system-tokens`` prompt and
   each adds its own ``--question-tokens`` question; all arrive at once after one warm-up
   request has put the system prompt in the cache. Run with the prefix cache on and off in the
   same process: prefill tokens computed, TTFT p50/p99 (seconds) and output tokens/s, and the
   off/on ratios.
2. Blocks held by ``n=4`` samples of one prompt right after their shared prefill, with fork
   sharing, against four independent requests of the same prompt with the cache off.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from collections.abc import Sequence
from typing import Any

import torch

from paged_serve.engine import LLM, SamplingParams
from paged_serve.engine.llm_engine import LLMEngine
from paged_serve.engine.model.loader import LoadedModel, load_model


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def shared_prefix_run(
    loaded: LoadedModel, prompts: list[list[int]], warmup: list[int], caching: bool, args
) -> dict[str, Any]:
    llm = LLM(
        loaded=loaded,
        kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=caching,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llm.generate([warmup], SamplingParams(max_tokens=1, temperature=0))
    sched = llm.engine.scheduler
    query0, hit0 = sched.prefix_query_tokens, sched.prefix_hit_tokens
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    hits = sched.prefix_hit_tokens - hit0
    query = sched.prefix_query_tokens - query0
    ttfts = [r.metrics.ttft for r in results]
    llm.engine.block_manager.check_integrity()
    return {
        "prefix_caching": caching,
        "prompt_tokens": query,
        "prefill_tokens_computed": query - hits,
        "prefix_hit_tokens": hits,
        "ttft_p50_s": round(percentile(ttfts, 0.5), 4),
        "ttft_p99_s": round(percentile(ttfts, 0.99), 4),
        "wall_s": round(wall, 3),
        "output_tokens_per_s": round(sum(len(r.token_ids) for r in results) / wall, 2),
        "tokens": [r.token_ids for r in results],
    }


def blocks_after_prefill(engine: LLMEngine, prompt: list[int], n: int, forked: bool) -> int:
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=0, ignore_eos=True)
    if forked:
        engine.add_request(prompt, dataclasses.replace(params, n=n))
    else:
        for _ in range(n):
            engine.add_request(prompt, params)
    engine.step()  # the prefill step: prompts computed, samples forked
    used = engine.block_manager.usage().used_blocks
    while engine.has_unfinished:
        engine.step()
    engine.block_manager.check_integrity()
    return used


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--question-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    loaded = load_model(None, dtype=torch.float32, device=torch.device("cpu"))
    rng = random.Random(args.seed)
    vocab = range(100, 40000)
    system = [rng.choice(vocab) for _ in range(args.system_tokens)]
    prompts = [
        system + [rng.choice(vocab) for _ in range(args.question_tokens)]
        for _ in range(args.requests)
    ]
    warmup = system + [rng.choice(vocab) for _ in range(args.question_tokens)]
    on = shared_prefix_run(loaded, prompts, warmup, True, args)
    off = shared_prefix_run(loaded, prompts, warmup, False, args)
    same = on.pop("tokens") == off.pop("tokens")
    engine = LLM(loaded=loaded, kv_cache_memory=args.kv_cache_memory).engine
    shared = blocks_after_prefill(engine, system, 4, forked=True)
    engine = LLM(
        loaded=loaded, kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=False
    ).engine
    unshared = blocks_after_prefill(engine, system, 4, forked=False)
    report = {
        "workload": vars(args),
        "cache_on": on,
        "cache_off": off,
        "greedy_tokens_identical": same,
        "ratios_off_over_on": {
            "prefill_tokens_computed": round(
                off["prefill_tokens_computed"] / on["prefill_tokens_computed"], 2
            ),
            "ttft_p50": round(off["ttft_p50_s"] / on["ttft_p50_s"], 2),
            "ttft_p99": round(off["ttft_p99_s"] / on["ttft_p99_s"], 2),
            "throughput_on_over_off": round(
                on["output_tokens_per_s"] / off["output_tokens_per_s"], 2
            ),
        },
        "n4_blocks_after_prefill": {"forked_shared": shared, "four_independent": unshared},
    }
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
