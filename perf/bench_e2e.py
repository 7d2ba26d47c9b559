"""End to end throughput: paged-serve against Hugging Face transformers on one workload.

    python -m perf.bench_e2e [--num-requests 24] [--device cpu] ...
    python -m perf.bench_e2e --device cuda --model-shape qwen3-0.6b ...   # no download

One synthetic workload (fixed seed) runs, in the same process, through:

* ``paged_serve``: ``engine.LLM.generate`` with every request submitted at once (continuous
  batching, chunked prefill, paged KV cache);
* ``hf_static``: one padded static batch through ``model.generate`` (left padding with an
  attention mask, greedy, ``max_new_tokens`` = the largest request's ``max_tokens``). The batch
  runs until its longest request is done; only each request's own ``max_tokens`` tokens are
  counted as output, the rest is padding work a static batch cannot avoid;
* ``hf_cb``: transformers' own continuous batching (``generate_batch``'s manager) with
  per-request ``max_new_tokens`` through ``ContinuousBatchingManager.add_request``, so it does
  exactly the useful work;
* ``hf_generate_batch``: the one-call ``model.generate_batch(...)``, which takes a single
  ``max_new_tokens`` for the whole batch: every request generates the largest ``max_tokens`` and
  only its own share is counted.

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
import math
import os
import platform
import random
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import transformers
from transformers import ContinuousBatchingConfig, GenerationConfig

from engine import LLM
from engine.model_loader import LoadedModel, load_model, resolve_dtype
from engine.sampling_params import SamplingParams
from perf.model_shapes import MODEL_SHAPES, random_weight_model

HF_SYSTEMS = ("hf_static", "hf_cb", "hf_generate_batch")
PROGRESS_PREFIX = "bench_e2e progress: "  # then one system's summary as JSON, on one line


@dataclass(frozen=True, slots=True)
class Workload:
    """Prompts (token ids) and each request's output length."""

    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)


@dataclass(slots=True)
class SystemResult:
    """One system's run. Times in seconds; ``tokens`` holds each request's useful outputs."""

    name: str
    wall_s: float | None = None
    useful_output_tokens: int = 0
    generated_tokens: int = 0
    output_tokens_per_s: float | None = None
    error: str | None = None
    notes: str = ""
    wall_s_runs: list[float | None] = field(default_factory=list)
    load_average: list[dict[str, list[float] | None]] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        del out["tokens"]
        return out


def make_workload(
    tokenizer: Any,
    vocab_size: int,
    *,
    num_requests: int,
    min_prompt: int,
    max_prompt: int,
    min_tokens: int,
    max_tokens: int,
    seed: int,
) -> Workload:
    """Random prompts (uniform lengths, ordinary-vocabulary ids) and uniform output lengths."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    ordinary = [t for t in range(vocab_size) if t not in special]
    rng = random.Random(seed)
    prompts = [
        [rng.choice(ordinary) for _ in range(rng.randint(min_prompt, max_prompt))]
        for _ in range(num_requests)
    ]
    outputs = [rng.randint(min_tokens, max_tokens) for _ in range(num_requests)]
    return Workload(prompts, outputs)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, fn: Callable[[], Any]) -> tuple[Any, float]:
    _sync(device)
    start = time.perf_counter()
    value = fn()
    _sync(device)
    return value, time.perf_counter() - start


def _finish(result: SystemResult, workload: Workload, wall: float) -> SystemResult:
    result.wall_s = round(wall, 3)
    result.useful_output_tokens = sum(len(t) for t in result.tokens)
    result.output_tokens_per_s = round(result.useful_output_tokens / wall, 2)
    if result.useful_output_tokens != workload.num_output_tokens:
        result.notes += (
            f" produced {result.useful_output_tokens} of {workload.num_output_tokens}"
            " requested tokens."
        )
    return result


# ---------------------------------------------------------------------------------- paged-serve
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
    warm = [workload.prompts[0][:8], workload.prompts[-1][:8]]
    llm.generate(warm, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    results, wall = _timed(device, lambda: llm.generate(workload.prompts, params))
    result = SystemResult(name, tokens=[list(r.token_ids) for r in results])
    result.generated_tokens = sum(len(t) for t in result.tokens)
    graphs = llm.engine.runner.graphs
    if graphs is not None:
        result.notes = (
            f"{sum(graphs.replays.values())} steps replayed decode graphs "
            f"(sizes up to {graphs.max_batch_size}, {graphs.padded_rows} padding rows)"
        )
    return _finish(result, workload, wall)


# ------------------------------------------------------------------------------ HF static batch
def hf_generate_padded(
    model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, pad_token_id: int
) -> list[list[int]]:
    """Greedy ``generate`` on a left-padded batch; returns every row's new tokens."""
    device = model.device
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        min_new_tokens=None,
        do_sample=False,
        eos_token_id=[],  # ignore EOS: every row generates max_new_tokens
        pad_token_id=pad_token_id,
    )
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids.to(device), attention_mask=mask.to(device), generation_config=config
        )
    return out[:, width:].tolist()


def run_hf_static(model: Any, workload: Workload, pad_token_id: int) -> SystemResult:
    """One padded batch of every request, run to the longest ``max_tokens``."""
    longest = max(workload.max_tokens)
    hf_generate_padded(model, [workload.prompts[0][:8], workload.prompts[-1][:8]], 4, pad_token_id)
    rows, wall = _timed(
        model.device, lambda: hf_generate_padded(model, workload.prompts, longest, pad_token_id)
    )
    result = SystemResult(
        "hf_static",
        tokens=[row[:m] for row, m in zip(rows, workload.max_tokens)],
        generated_tokens=sum(len(r) for r in rows),
        notes=(
            f"padded static batch of {len(rows)} run to max_new_tokens={longest}; only each "
            "request's own max_tokens count as output."
        ),
    )
    return _finish(result, workload, wall)


# ---------------------------------------------------------------------- HF continuous batching
def hf_cb_page_size(config: ContinuousBatchingConfig) -> int:
    """Tokens per KV page of HF's CB cache: ``page_size`` in the transformers CI installs
    (5.24), ``block_size`` in 5.17 (the GPU machine's), which has no ``page_size``."""
    page_size = getattr(config, "page_size", None)
    return int(page_size if page_size is not None else config.block_size)


def hf_cb_config(args: argparse.Namespace, kv_tokens: int | None) -> ContinuousBatchingConfig:
    """HF's CB sized like paged-serve: the same KV capacity in tokens and the same budgets.

    On CPU transformers otherwise sizes the cache from total system RAM.
    """
    page_size = hf_cb_page_size(ContinuousBatchingConfig())
    return ContinuousBatchingConfig(
        num_blocks=None if kv_tokens is None else math.ceil(kv_tokens / page_size),
        max_batch_tokens=args.max_num_batched_tokens,
        max_requests_per_batch=args.max_num_seqs,
    )


def _greedy_no_eos(max_new_tokens: int, pad_token_id: int) -> GenerationConfig:
    # eos_token_id=-1 is continuous batching's "no EOS".
    return GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=pad_token_id
    )


def _check_outputs(outputs: Sequence[Any], n: int) -> str | None:
    missing = n - len(outputs)
    failed = [o.error for o in outputs if o.error is not None]
    if missing or failed:
        return f"{missing} requests missing, {len(failed)} failed: {failed[:1]}"
    return None


def hf_cb_per_request(
    model: Any,
    prompts: Sequence[Sequence[int]],
    max_tokens: Sequence[int],
    cb_config: ContinuousBatchingConfig,
    pad_token_id: int,
) -> list[Any]:
    """transformers' CB manager, each request with its own ``max_new_tokens``."""
    config = _greedy_no_eos(max(max_tokens), pad_token_id)
    done: dict[str, Any] = {}
    # No inference_mode() here: the manager's worker thread updates tensors this thread creates
    # in add_request, which transformers 5.17 then refuses as inference tensors.
    with model.continuous_batching_context_manager(
        generation_config=config, continuous_batching_config=cb_config, block=True, timeout=5
    ) as manager:
        ids = [
            manager.add_request(
                input_ids=list(p), request_id=f"r{i}", max_new_tokens=m, eos_token_id=-1
            )
            for i, (p, m) in enumerate(zip(prompts, max_tokens))
        ]
        while len(done) < len(ids):
            out = manager.get_result(timeout=1)
            if out is None:
                if not manager.is_running():
                    break
                continue
            if out.is_finished():
                done[out.request_id] = out
    return [done[i] for i in ids if i in done]


def run_hf_cb(
    model: Any, workload: Workload, cb_config: ContinuousBatchingConfig, pad_token_id: int
) -> SystemResult:
    result = SystemResult(
        "hf_cb",
        notes="transformers continuous batching manager, per-request max_new_tokens.",
    )
    warm = [workload.prompts[0][:8], workload.prompts[-1][:8]]
    hf_cb_per_request(model, warm, [4, 4], cb_config, pad_token_id)
    outputs, wall = _timed(
        model.device,
        lambda: hf_cb_per_request(
            model, workload.prompts, workload.max_tokens, cb_config, pad_token_id
        ),
    )
    result.error = _check_outputs(outputs, len(workload.prompts))
    result.tokens = [list(o.generated_tokens) for o in outputs]
    result.generated_tokens = sum(len(t) for t in result.tokens)
    return _finish(result, workload, wall)


def run_hf_generate_batch(
    model: Any, workload: Workload, cb_config: ContinuousBatchingConfig, pad_token_id: int
) -> SystemResult:
    longest = max(workload.max_tokens)
    result = SystemResult(
        "hf_generate_batch",
        notes=(
            f"model.generate_batch takes one max_new_tokens: all requests ran to {longest}; only "
            "each request's own max_tokens count as output."
        ),
    )
    warm = [workload.prompts[0][:8], workload.prompts[-1][:8]]
    model.generate_batch(
        inputs=warm,
        generation_config=_greedy_no_eos(4, pad_token_id),
        continuous_batching_config=cb_config,
    )
    config = _greedy_no_eos(longest, pad_token_id)
    outputs, wall = _timed(
        model.device,
        lambda: list(
            model.generate_batch(
                inputs=workload.prompts,
                generation_config=config,
                continuous_batching_config=cb_config,
            ).values()
        ),
    )
    result.error = _check_outputs(outputs, len(workload.prompts))
    rows = [list(o.generated_tokens) for o in outputs]
    result.generated_tokens = sum(len(r) for r in rows)
    result.tokens = [r[:m] for r, m in zip(rows, workload.max_tokens)]
    return _finish(result, workload, wall)


# ------------------------------------------------------------------------------------ agreement
def agreement(reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]]) -> dict:
    """Token-for-token agreement of greedy outputs, request by request.

    A greedy sequence that differs once continues differently, so the matched length is the
    length of the common prefix; ``first_divergence`` maps request index to that position.
    """
    matched = total = exact = 0
    divergence: dict[int, int] = {}
    for i, (ref, out) in enumerate(zip(reference, other)):
        prefix = 0
        while prefix < min(len(ref), len(out)) and ref[prefix] == out[prefix]:
            prefix += 1
        matched += prefix
        total += len(ref)
        if prefix == len(ref) == len(out):
            exact += 1
        else:
            divergence[i] = prefix
    return {
        "requests": min(len(reference), len(other)),
        "exact_requests": exact,
        "token_match_rate": round(matched / total, 4) if total else None,
        "first_divergence": divergence,
    }


# ----------------------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--min-prompt", type=int, default=10, help="shortest prompt, tokens")
    p.add_argument("--max-prompt", type=int, default=400, help="longest prompt, tokens")
    p.add_argument("--min-tokens", type=int, default=8, help="smallest max_tokens")
    p.add_argument("--max-tokens", type=int, default=96, help="largest max_tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--dtype", default="auto", help="auto: float32 on CPU, bfloat16 on CUDA")
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


def _guarded(name: str, fn: Callable[[], SystemResult]) -> SystemResult:
    """Run one HF system; a failure is reported in the output, not raised."""
    try:
        return fn()
    except Exception as exc:  # any baseline failure is a result to report, not a crash
        return SystemResult(name, error=f"{type(exc).__name__}: {exc}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    source = _source_revision()  # before the runs: the tree may change while they go on
    if args.threads is not None:
        torch.set_num_threads(args.threads)
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
    if args.enforce_eager:
        make_llm = make_eager_llm
    bm = make_eager_llm().engine.block_manager  # sizes only: no graphs to capture
    kv_tokens = bm.num_blocks * bm.block_size
    hf = load().model  # a second copy: the engine swaps the first one's attention
    cb_config = hf_cb_config(args, kv_tokens if device.type == "cpu" else None)

    systems: list[tuple[str, Callable[[], SystemResult]]] = [
        ("paged_serve", lambda: run_paged(make_llm, workload, device))
    ]
    if args.compare_eager and not args.enforce_eager:
        systems.append(
            (
                "paged_serve_eager",
                lambda: run_paged(make_eager_llm, workload, device, "paged_serve_eager"),
            )
        )
    if not args.skip_hf_static:
        systems.append(("hf_static", lambda: run_hf_static(hf, workload, pad_token_id)))
    if not args.skip_hf_batch and args.hf_batch_api in ("both", "manager"):
        systems.append(("hf_cb", lambda: run_hf_cb(hf, workload, cb_config, pad_token_id)))
    if not args.skip_hf_batch and args.hf_batch_api in ("both", "generate_batch"):
        systems.append(
            (
                "hf_generate_batch",
                lambda: run_hf_generate_batch(hf, workload, cb_config, pad_token_id),
            )
        )

    # Round-robin repeats, so a burst of load from other processes hits every system alike;
    # each system keeps its fastest run (interference only ever adds time).
    results: dict[str, SystemResult] = {}
    for _ in range(args.repeats):
        for name, fn in systems:
            before = _load_average()
            result = fn() if name.startswith("paged_serve") else _guarded(name, fn)
            load = {"before": before, "after": _load_average()}
            results[name] = _keep_fastest(results.get(name), result, load)
            _release_memory(device)
            # One line per finished run, so a run stopped at a deadline still leaves figures.
            print(PROGRESS_PREFIX + json.dumps(results[name].summary()), flush=True)

    # Agreement: against the padded HF batch, and against HF generate on single requests.
    checks: dict[str, Any] = {}
    static = results.get("hf_static")
    for name, r in results.items():
        if name != "hf_static" and static is not None and static.tokens and r.tokens:
            checks[f"{name}_vs_hf_static"] = agreement(static.tokens, r.tokens)
    n_alone = min(args.check_requests, len(workload.prompts))
    if n_alone > 0:
        alone = [
            hf_generate_padded(hf, [workload.prompts[i]], workload.max_tokens[i], pad_token_id)[0]
            for i in range(n_alone)
        ]
        for name, r in results.items():
            if r.tokens:
                checks[f"{name}_vs_hf_alone"] = agreement(alone, r.tokens[:n_alone])

    paged = results["paged_serve"].output_tokens_per_s
    ratios = {
        f"paged_serve/{name}": round(paged / r.output_tokens_per_s, 3)
        for name, r in results.items()
        if name != "paged_serve" and r.output_tokens_per_s
    }
    goal = 3.0 if device.type == "cuda" else 1.5  # issue 6 on a GPU; issue 2 on a CPU
    hf_rates = [r.output_tokens_per_s for n, r in results.items() if n in HF_SYSTEMS]
    best_hf = max((x for x in hf_rates if x), default=None)
    return {
        "workload": {
            "num_requests": len(workload.prompts),
            "prompt_tokens": workload.num_prompt_tokens,
            "output_tokens": workload.num_output_tokens,
            "prompt_lengths": [len(p) for p in workload.prompts],
            "max_tokens": workload.max_tokens,
            "seed": args.seed,
            "greedy": True,
            "ignore_eos": True,
        },
        "engine_config": {
            "model_shape": args.model_shape,  # None: the default model
            "device": str(device),
            "dtype": str(dtype).removeprefix("torch."),
            "kv_cache_tokens": kv_tokens,
            "kv_cache_memory": args.kv_cache_memory,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_num_seqs": args.max_num_seqs,
            "enforce_eager": args.enforce_eager,
            "hf_cb_page_size": hf_cb_page_size(cb_config),
            "hf_cb_num_blocks": cb_config.num_blocks,
        },
        "source": source,
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "torch_threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(),
        },
        "systems": {name: r.summary() for name, r in results.items()},
        "ratios": ratios,
        "target": {
            "paged_over_best_hf": round(paged / best_hf, 3) if best_hf else None,
            "goal": goal,
            "met": bool(best_hf) and paged / best_hf >= goal,
        },
        "agreement": checks,
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
