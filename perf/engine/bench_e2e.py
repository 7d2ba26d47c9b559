"""End to end throughput: paged-serve against Hugging Face transformers on one workload.

    python -m perf.engine.bench_e2e [--num-requests 24] [--device cpu] ...
    python -m perf.engine.bench_e2e --device cuda --model-shape qwen3-0.6b ...   # no download

One synthetic workload (fixed seed) runs, in the same process, through:

* ``paged_serve``: ``engine.LLM.generate`` with every request submitted at once (continuous
  batching, chunked prefill, paged KV cache); ``paged_serve_eager`` the same without decode
  CUDA graphs (``--compare-eager``);
* ``hf_static``, ``hf_cb``, ``hf_generate_batch``: Hugging Face transformers' padded static
  batch, its continuous batching with per-request limits, and its one-call ``generate_batch``
  (``perf.engine.hf_baselines`` says how each counts its output).

All are greedy with EOS ignored, so every system produces exactly the requested token counts.
Prompts are random ids from the tokenizer's ordinary (non-special) vocabulary. Each timed run is
preceded by a small untimed warm-up call; paged-serve gets a fresh engine per run, so its prefix
cache starts cold. ``--repeats N`` runs the systems round-robin N times and keeps each one's
fastest run (all wall times are reported). Throughput is useful output tokens per second of wall
time (prompt tokens are not counted). ``--threads`` sets torch's CPU thread count.

The greedy tokens of the other systems are compared with ``hf_static`` and with HF ``generate``
run on each of the first ``--check-requests`` requests alone (unpadded), the reference
paged-serve's tests use.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from transformers import ContinuousBatchingConfig

from paged_serve.engine import LLM
from paged_serve.engine.model.loader import LoadedModel, load_model
from paged_serve.engine.platform.dtype_choice import resolve_dtype
from paged_serve.engine.sampling_params import SamplingParams
from perf.engine.e2e_workload import SystemResult, Workload, agreement, finish, make_workload, timed
from perf.engine.hf_baselines import (
    HF_SYSTEMS,
    hf_cb_config,
    hf_cb_page_size,
    hf_generate_padded,
    run_hf_cb,
    run_hf_generate_batch,
    run_hf_static,
)
from perf.engine.model_shapes import MODEL_SHAPES, random_weight_model

PROGRESS_PREFIX = "bench_e2e progress: "  # then one system's summary as JSON, on one line


@dataclass(frozen=True, slots=True)
class SpeedGoals:
    """The end-to-end targets: paged-serve's output tokens/s over the best HF system's, per
    device type. The report says whether the run met its device's goal; nothing asserts it.

    The CPU goal is the lower one because there both systems spend most of their time in the
    same torch matmuls (docs/measurements/engine-vs-hf.md, "Where paged-serve's time goes"): only
    batching and scheduling can win. On a GPU the paged kernels and decode graphs add their share.
    """

    cuda: float
    cpu: float

    def for_device(self, device: torch.device) -> float:
        return self.cuda if device.type == "cuda" else self.cpu


E2E_GOALS = SpeedGoals(cuda=3.0, cpu=1.5)


def run_paged(
    make_llm: Callable[[], LLM], workload: Workload, device: torch.device, name: str = "paged_serve"
) -> SystemResult:
    """All requests submitted at once to ``LLM.generate`` of a fresh engine (cold prefix cache).

    ``notes`` says how many steps replayed a decode graph (CUDA without ``--enforce-eager``).
    """
    llm = make_llm()
    params = [
        SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in workload.max_tokens
    ]
    llm.generate(
        workload.warmup_prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    )
    results, wall = timed(device, lambda: llm.generate(workload.prompts, params))
    result = SystemResult(name, tokens=[list(r.token_ids) for r in results])
    result.generated_tokens = sum(len(t) for t in result.tokens)
    graphs = llm.engine.runner.graphs
    if graphs is not None:
        result.notes = (
            f"{sum(graphs.replays.values())} steps replayed decode graphs "
            f"(sizes up to {graphs.max_batch_size}, {graphs.padded_rows} padding rows)"
        )
    return finish(result, workload, wall)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--min-prompt", type=int, default=10, help="shortest prompt, tokens")
    p.add_argument("--max-prompt", type=int, default=400, help="longest prompt, tokens")
    p.add_argument("--min-tokens", type=int, default=8, help="smallest max_tokens")
    p.add_argument("--max-tokens", type=int, default=96, help="largest max_tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--dtype", default="auto", help="auto: as paged-serve's --dtype auto")
    p.add_argument(
        "--model-shape",
        choices=sorted(MODEL_SHAPES),
        default=None,
        help="a random-weight model with this model's shapes, built on the spot (no download; "
        "prompts are random token ids) instead of the default model",
    )
    p.add_argument(
        "--kv-cache-memory",
        type=int,
        default=None,
        help="KV cache bytes (both engines; default: 1 GiB on CPU, the free memory on CUDA)",
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)"
    )
    p.add_argument(
        "--check-requests", type=int, default=3, help="requests checked against HF alone"
    )
    p.add_argument(
        "--repeats", type=int, default=1, help="timed runs per system (round-robin); fastest kept"
    )
    p.add_argument(
        "--enforce-eager", action="store_true", help="paged-serve without decode CUDA graphs"
    )
    p.add_argument(
        "--compare-eager",
        action="store_true",
        help="also run paged-serve with --enforce-eager (paged_serve_eager), for the graphs' gain",
    )
    p.add_argument("--skip-hf-static", action="store_true")
    p.add_argument("--skip-hf-batch", action="store_true", help="skip both HF CB variants")
    p.add_argument(
        "--hf-batch-api",
        choices=("both", "manager", "generate_batch"),
        default="both",
        help="which HF continuous-batching variants to run",
    )
    args = p.parse_args(argv)
    if not 1 <= args.min_prompt <= args.max_prompt:
        p.error("need 1 <= --min-prompt <= --max-prompt")
    if not 1 <= args.min_tokens <= args.max_tokens:
        p.error("need 1 <= --min-tokens <= --max-tokens")
    if args.num_requests < 1:
        p.error("--num-requests must be >= 1")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available")
    return args


def _source_revision() -> dict[str, Any] | None:
    """The commit measured, and engine/kernels files changed since it (None outside git)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "engine", "kernels"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        return None
    return {"commit": head, "uncommitted": [line[3:] for line in dirty if line.strip()]}


def _keep_fastest(
    best: SystemResult | None, new: SystemResult, load: dict[str, list[float] | None]
) -> SystemResult:
    """Fold one more run of a system into its result: all wall times, the fastest one's rate."""
    runs = (best.wall_s_runs if best is not None else []) + [new.wall_s]
    loads = (best.load_average if best is not None else []) + [load]
    if best is None or best.wall_s is None or (new.wall_s is not None and new.wall_s < best.wall_s):
        best = new
    best.wall_s_runs, best.load_average = runs, loads
    return best


def _load_average() -> list[float] | None:
    """The 1-minute load average: other processes on a shared machine skew CPU timings."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def _release_memory(device: torch.device) -> None:
    """Hand a finished system's memory back to the driver: the paged engine's KV cache takes
    most of the GPU, and HF sizes its continuous-batching cache from what the driver reports."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass(frozen=True, slots=True)
class BenchSetup:
    """What every system's runs share, built once before any is timed."""

    device: torch.device
    dtype: torch.dtype
    workload: Workload
    make_llm: Callable[[], LLM]  # paged-serve as asked (decode graphs unless --enforce-eager)
    make_eager_llm: Callable[[], LLM]
    hf: Any  # a second copy of the model: the engine swaps the first one's attention
    pad_token_id: int
    kv_tokens: int  # paged-serve's KV capacity
    cb_config: ContinuousBatchingConfig


def prepare(args: argparse.Namespace) -> BenchSetup:
    """Load the model twice (paged-serve, HF), draw the workload, size HF's CB like ours."""
    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype, device)

    def load() -> LoadedModel:
        if args.model_shape is not None:  # same seed: every call gives the same weights
            return random_weight_model(args.model_shape, dtype=dtype, device=device, seed=args.seed)
        return load_model(None, dtype=dtype, device=device)

    paged_model = load()
    tokenizer = paged_model.tokenizer
    pad_token_id = getattr(tokenizer, "pad_token_id", None)
    pad_token_id = 0 if pad_token_id is None else pad_token_id  # no tokenizer: --model-shape
    workload = make_workload(
        tokenizer,
        int(paged_model.model.config.vocab_size),
        num_requests=args.num_requests,
        min_prompt=args.min_prompt,
        max_prompt=args.max_prompt,
        min_tokens=args.min_tokens,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    make_llm = functools.partial(
        LLM,
        loaded=paged_model,
        device=args.device,
        dtype=args.dtype,
        kv_cache_memory=args.kv_cache_memory,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
    )
    make_eager_llm = functools.partial(make_llm, enforce_eager=True)
    bm = make_eager_llm().engine.block_manager  # sizes only: no graphs to capture
    kv_tokens = bm.num_blocks * bm.block_size
    return BenchSetup(
        device=device,
        dtype=dtype,
        workload=workload,
        make_llm=make_eager_llm if args.enforce_eager else make_llm,
        make_eager_llm=make_eager_llm,
        hf=load().model,
        pad_token_id=pad_token_id,
        kv_tokens=kv_tokens,
        cb_config=hf_cb_config(
            kv_tokens if device.type == "cpu" else None,
            max_batch_tokens=args.max_num_batched_tokens,
            max_requests=args.max_num_seqs,
        ),
    )


def chosen_systems(args: argparse.Namespace) -> list[str]:
    """The systems to time, in order, as the selection flags ask."""
    names = ["paged_serve"]
    if args.compare_eager and not args.enforce_eager:
        names.append("paged_serve_eager")
    if not args.skip_hf_static:
        names.append("hf_static")
    if not args.skip_hf_batch and args.hf_batch_api in ("both", "manager"):
        names.append("hf_cb")
    if not args.skip_hf_batch and args.hf_batch_api in ("both", "generate_batch"):
        names.append("hf_generate_batch")
    return names


def run_system(name: str, setup: BenchSetup) -> SystemResult:
    """One timed run of ``name``; an HF system's failure is reported in its result."""
    s = setup
    if name == "paged_serve":
        return run_paged(s.make_llm, s.workload, s.device)
    if name == "paged_serve_eager":
        return run_paged(s.make_eager_llm, s.workload, s.device, name)
    hf_runs: dict[str, Callable[[], SystemResult]] = {
        "hf_static": lambda: run_hf_static(s.hf, s.workload, s.pad_token_id),
        "hf_cb": lambda: run_hf_cb(s.hf, s.workload, s.cb_config, s.pad_token_id),
        "hf_generate_batch": lambda: run_hf_generate_batch(
            s.hf, s.workload, s.cb_config, s.pad_token_id
        ),
    }
    try:
        return hf_runs[name]()
    except Exception as exc:  # any baseline failure is a result to report, not a crash
        return SystemResult(name, error=f"{type(exc).__name__}: {exc}")


def time_systems(names: Sequence[str], setup: BenchSetup, repeats: int) -> dict[str, SystemResult]:
    """Each system's fastest of ``repeats`` runs, with every run's wall time.

    The systems take turns (round-robin), so a burst of load from other processes hits every
    system alike; the fastest run is kept because interference only ever adds time.
    """
    results: dict[str, SystemResult] = {}
    for _ in range(repeats):
        for name in names:
            before = _load_average()
            result = run_system(name, setup)
            load = {"before": before, "after": _load_average()}
            results[name] = _keep_fastest(results.get(name), result, load)
            _release_memory(setup.device)
            # One line per finished run, so a run stopped at a deadline still leaves figures.
            print(PROGRESS_PREFIX + json.dumps(results[name].summary()), flush=True)
    return results


def agreement_checks(
    results: dict[str, SystemResult], setup: BenchSetup, check_requests: int
) -> dict[str, Any]:
    """Every system's greedy tokens against the padded HF batch, and against HF ``generate``
    on each of the first ``check_requests`` requests alone."""
    checks: dict[str, Any] = {}
    static = results.get("hf_static")
    for name, r in results.items():
        if name != "hf_static" and static is not None and static.tokens and r.tokens:
            checks[f"{name}_vs_hf_static"] = agreement(static.tokens, r.tokens)
    workload = setup.workload
    n_alone = min(check_requests, len(workload.prompts))
    if n_alone > 0:
        alone = [
            hf_generate_padded(
                setup.hf, [workload.prompts[i]], workload.max_tokens[i], setup.pad_token_id
            )[0]
            for i in range(n_alone)
        ]
        for name, r in results.items():
            if r.tokens:
                checks[f"{name}_vs_hf_alone"] = agreement(alone, r.tokens[:n_alone])
    return checks


def speed_ratios(results: dict[str, SystemResult], goal: float) -> dict[str, Any]:
    """The report's ``ratios`` (paged-serve over each other system) and ``target`` (over the
    best HF system, against ``goal``)."""
    paged = results["paged_serve"].output_tokens_per_s
    ratios = {
        f"paged_serve/{name}": round(paged / r.output_tokens_per_s, 3)
        for name, r in results.items()
        if name != "paged_serve" and r.output_tokens_per_s
    }
    hf_rates = [r.output_tokens_per_s for n, r in results.items() if n in HF_SYSTEMS]
    best_hf = max((x for x in hf_rates if x), default=None)
    return {
        "ratios": ratios,
        "target": {
            "paged_over_best_hf": round(paged / best_hf, 3) if best_hf else None,
            "goal": goal,
            "met": bool(best_hf) and paged / best_hf >= goal,
        },
    }


def _engine_config(args: argparse.Namespace, setup: BenchSetup) -> dict[str, Any]:
    return {
        "model_shape": args.model_shape,  # None: the default model
        "device": str(setup.device),
        "dtype": str(setup.dtype).removeprefix("torch."),
        "kv_cache_tokens": setup.kv_tokens,
        "kv_cache_memory": args.kv_cache_memory,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "enforce_eager": args.enforce_eager,
        "hf_cb_page_size": hf_cb_page_size(setup.cb_config),
        "hf_cb_num_blocks": setup.cb_config.num_blocks,
    }


def _machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time the chosen systems on one workload; the report as a JSON-ready dict."""
    source = _source_revision()  # before the runs: the tree may change while they go on
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    setup = prepare(args)
    results = time_systems(chosen_systems(args), setup, args.repeats)
    return {
        "workload": setup.workload.summary(args.seed),
        "engine_config": _engine_config(args, setup),
        "source": source,
        "machine": _machine(),
        "systems": {name: r.summary() for name, r in results.items()},
        **speed_ratios(results, E2E_GOALS.for_device(setup.device)),
        "agreement": agreement_checks(results, setup, args.check_requests),
    }


def print_table(report: dict[str, Any], file: Any = sys.stdout) -> None:
    print(f"{'system':<20} {'wall s':>9} {'out tok':>8} {'gen tok':>8} {'tok/s':>9}", file=file)
    for name, r in report["systems"].items():
        if r["error"] and r["wall_s"] is None:
            print(f"{name:<20} ERROR {r['error']}", file=file)
            continue
        print(
            f"{name:<20} {r['wall_s']:>9.2f} {r['useful_output_tokens']:>8} "
            f"{r['generated_tokens']:>8} {r['output_tokens_per_s']:>9.2f}",
            file=file,
        )
    for name, ratio in report["ratios"].items():
        print(f"{name:<32} {ratio:.3f}x", file=file)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    report = run(parse_args(argv))
    print(json.dumps(report, indent=2))
    print_table(report)
    return report


if __name__ == "__main__":
    main()
