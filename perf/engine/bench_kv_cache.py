"""A quantized KV cache on the CPU, on the default model (SmolLM2-135M-Instruct, fp32): what it
holds, how far it moves the predictions, and long-context decode speed, against the fp32 cache
in the same run.

    python -m perf.engine.bench_kv_cache [--contexts 1024 4096 8000] [--streams 1 4]

1. Capacity: tokens a 256 MiB KV budget holds for each ``--kv-cache-dtype``.
2. Accuracy: this project's LICENSE, ``--tokens`` tokens teacher-forced (``perf/engine/
   kv_agreement.py``): top-1 agreement with the fp32 cache and the mean and largest
   |delta logprob| of the text's own tokens.
3. Speed: ``S`` streams each with a ``context``-token prompt (random ids, computed once before
   the timed runs, which find them in the prefix cache) decode ``--new-tokens`` tokens together;
   the time per output token after the first (TPOT, the requests' own metric, median over
   streams and ``--repeats`` runs) for each cache, and its ratio to fp32's.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from paged_serve.engine.llm import LLM
from paged_serve.engine.model.loader import LoadedModel, load_model
from paged_serve.engine.sampling_params import SamplingParams
from perf.engine.kv_agreement import agreement

DTYPES = ("auto", "int8", "fp8", "fp8_e5m2")
LICENSE = Path(__file__).parents[2] / "LICENSE"


def engine(model: LoadedModel, kv_cache_dtype: str, memory: int) -> LLM:
    private = dataclasses.replace(model, model=copy.deepcopy(model.model))
    return LLM(loaded=private, kv_cache_memory=memory, kv_cache_dtype=kv_cache_dtype)


def tpot(llm: LLM, context: int, streams: int, args: argparse.Namespace) -> float:
    """Median seconds per output token of ``streams`` requests of ``context`` prompt tokens,
    decoding together: the prompts are computed once first (a one-token run), so every timed
    run finds them in the prefix cache and its steps after the first are decode steps."""
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    generator = torch.Generator().manual_seed(context)
    prompts = [
        torch.randint(100, 40000, (context,), generator=generator).tolist() for _ in range(streams)
    ]
    llm.engine.block_manager.evict_cached()
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0))
    times = []
    for _ in range(args.repeats):
        times += [r.metrics.tpot for r in llm.generate(prompts, params)]
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8000])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES))
    args = parser.parse_args()
    model = load_model(None, dtype=torch.float32, device=torch.device("cpu"))
    report: dict[str, Any] = {"threads": torch.get_num_threads()}
    report["capacity_tokens_256MiB"] = {
        name: engine(model, name, 256 << 20).engine.runner.kv_cache.num_tokens
        for name in args.dtypes
    }
    tokens = model.tokenizer(LICENSE.read_text()).input_ids[: args.tokens]
    memory = max(args.streams) * (max(args.contexts) + args.new_tokens + 32) * 30 * 2 * 3 * 64 * 4
    llms = {name: engine(model, name, memory) for name in args.dtypes}
    if not args.skip_accuracy:
        report["accuracy"] = {
            name: dataclasses.asdict(agreement(llms["auto"], llm, tokens))
            for name, llm in llms.items()
            if name != "auto"
        }
    print(json.dumps(report), flush=True)
    speed = []
    for context in args.contexts:
        for streams in args.streams:
            row: dict[str, Any] = {"context": context, "streams": streams}
            for name, llm in llms.items():
                row[f"{name}_tpot_ms"] = round(1000 * tpot(llm, context, streams, args), 2)
            for name in args.dtypes[1:]:
                row[f"{name}_ratio"] = round(row[f"{name}_tpot_ms"] / row["auto_tpot_ms"], 3)
            speed.append(row)
            print(json.dumps(row), flush=True)
    report["speed"] = speed
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
