"""Serving benchmark: streaming completions through each system's own OpenAI server.

    python -m perf.serving.bench_serving [--system paged-serve:float32] [--system llama-cpp-f32] ...
        [--workload decode-heavy|long-prompt|shared-prefix|concurrency-1|concurrency-8|all]
        [--num-requests N] [--request-rate R] [--repeats N] [--check-requests 4] [--no-check]
        [--temperature T [--top-p P]] [--model HF_FOLDER]
    python -m perf.serving.bench_serving --system external --base-url http://127.0.0.1:8000 ...

Systems (``perf.serving.systems``): ``paged-serve[:DTYPE]`` started from this checkout,
``llama-cpp-f32`` / ``llama-cpp-q4_1`` (llama.cpp's ``llama-server``, built by
``python -m perf.serving.llama_cpp build``), or an ``external`` server at ``--base-url``; a system
may carry flags of its own (``--system "paged-serve:float32 --quantization int8"``). Workloads:
``perf.serving.workloads``. The same token-id prompts go to every system. The model is the
embedded SmolLM2 unless ``--model`` names a Hugging Face folder: then paged-serve serves it, the
llama.cpp systems serve its GGUF made by llama.cpp's own converter (``perf.serving.llama_cpp``),
and the prompts and HF references come from its tokenizer and weights
(``perf.serving.bench_moe_serving`` runs this on random mixture-of-experts models).

First each system's correctness check, then the timed runs:

1. the correctness check (``perf.serving.check``) on one server: every request of every
   workload sent greedy and non-streamed; each must return exactly ``max_tokens`` tokens, and a
   sample is compared with Hugging Face greedy ``generate`` (computed before any server starts,
   so it never competes with one for the CPU). paged-serve in float32 must equal HF fp32 token
   for token; other systems get an agreement rate. A system that fails is not timed;
2. each timed run on a freshly started server (so every run starts with a cold prefix cache),
   the systems taking turns (repeat by repeat, workload by workload: ``timing_order``),
   after two short untimed warm-up requests: streaming requests, all sent at once (or at Poisson
   arrivals with ``--request-rate``; the ``concurrency-N`` workloads are a closed loop of N
   streams), measured per SSE chunk at the client (``perf.serving.metrics``). Greedy, or with
   ``--temperature`` sampled: the request's index is its seed, and top_k 0, min_p 0 and
   ``--top-p`` go with it, since llama-server otherwise applies its own default filters.

It prints the commit, the load average at the start and the end, a markdown table (output
tok/s, request/s, TTFT, ITL, TPOT and E2E p50/p99), and writes the table and a JSON report to
``--out-dir``; with ``--repeats N`` also each system and workload's medians over the repeats.
It exits 1 if a check failed. Timing on a shared machine is noisy: look at the load averages,
and compare systems by their medians over interleaved repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from perf.serving.check import (
    CheckResult,
    check_replies,
    hf_references,
    llama_cpp_eog_ids,
    sample_indices,
)
from perf.serving.client import (
    complete_all,
    new_session,
    run_closed_loop,
    run_open_loop,
    served_model,
)
from perf.serving.metrics import markdown_table, median_table, summarize
from perf.serving.systems import REPO_ROOT, Server, System, parse_system
from perf.serving.workloads import WORKLOADS, ServingWorkload, arrival_offsets

WARMUP_PROMPT_TOKENS, WARMUP_MAX_TOKENS = 8, 4


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--system",
        action="append",
        default=None,
        help="paged-serve[:DTYPE] (default paged-serve:float32), llama-cpp-f32, llama-cpp-q4_1 "
        "or external, optionally with flags of its own, e.g. 'paged-serve:float32 "
        "--quantization int8'; repeat to compare several in one run",
    )
    p.add_argument(
        "--workload",
        action="append",
        default=None,
        choices=[*WORKLOADS, "all"],
        help="repeatable (default decode-heavy)",
    )
    p.add_argument("--num-requests", type=int, default=None, help="override the mix's count")
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s, Poisson arrivals (default inf: all at once); open-loop mixes only",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="time sampled requests at this temperature (a seed per request; top_k 0, min_p 0"
        " and --top-p, so every system filters alike); default greedy. The check stays greedy",
    )
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature (default 1)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per system and workload")
    p.add_argument(
        "--check-requests", type=int, default=4, help="requests per workload compared with HF"
    )
    p.add_argument("--no-check", action="store_true", help="skip the correctness check")
    p.add_argument("--base-url", default=None, help="the server of --system external")
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="an extra paged-serve flag, e.g. --server-arg=--max-num-seqs=32 (repeatable)",
    )
    p.add_argument(
        "--llama-arg",
        action="append",
        default=[],
        help="an extra llama-server flag, e.g. --llama-arg=--no-cache-prompt (repeatable)",
    )
    p.add_argument("--llama-slots", type=int, default=32, help="llama-server --parallel")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="llama-server --threads (default: torch's CPU thread count, what paged-serve uses)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="a Hugging Face folder every started system serves (llama.cpp: its GGUF converted "
        "by llama.cpp's convert_hf_to_gguf.py); default the embedded SmolLM2",
    )
    p.add_argument("--label", default="", help="a tag for the report, e.g. smoke")
    p.add_argument("--out-dir", type=Path, default=Path("/tmp/bench_serving"))
    args = p.parse_args(argv)
    workloads = args.workload or ["decode-heavy"]
    args.workload = list(WORKLOADS) if "all" in workloads else list(dict.fromkeys(workloads))
    try:
        args.systems = [
            parse_system(
                s,
                base_url=args.base_url,
                extra_args=tuple(args.llama_arg if s.startswith("llama") else args.server_arg),
                model=args.model,
            )
            for s in args.system or ["paged-serve:float32"]
        ]
    except ValueError as exc:
        p.error(str(exc))
    if args.repeats < 1 or (args.num_requests is not None and args.num_requests < 1):
        p.error("--repeats and --num-requests must be >= 1")
    if args.request_rate <= 0:
        p.error("--request-rate must be > 0")
    args.sampling = None
    if args.temperature is not None:
        if args.temperature <= 0 or not 0 < args.top_p <= 1:
            p.error("--temperature must be > 0 and --top-p in (0, 1]")
        args.sampling = {
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": 0,
            "min_p": 0.0,
        }
    return args


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def source_revision() -> dict[str, Any]:
    """The commit measured and how many files differ from it."""

    def git(*cmd: str) -> str:
        out = subprocess.run(["git", *cmd], cwd=REPO_ROOT, capture_output=True, text=True)
        return out.stdout.strip()

    dirty = [line for line in git("status", "--porcelain").splitlines() if line.strip()]
    return {"commit": git("rev-parse", "--short", "HEAD"), "uncommitted_files": len(dirty)}


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def load_tokenizer(model: str | None = None) -> Any:
    """The tokenizer of ``model`` (a Hugging Face folder; None: the embedded default)."""
    from transformers import AutoTokenizer

    from paged_serve.engine.model.loader import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path(model)[0])


# ----------------------------------------------------------------------------- the check
def reference_key(system: System) -> tuple[str, bool]:
    return system.hf_dtype, system.suppress_eog


def compute_references(
    systems: Sequence[System],
    workloads: Sequence[ServingWorkload],
    tokenizer: Any,
    k: int,
    model_path: str | None = None,
) -> dict[tuple[str, bool], dict[str, dict[int, list[int]]]]:
    """HF greedy references for every (precision, EOG rule) the systems need, per workload, of
    ``model_path`` (a Hugging Face folder; None: the embedded default)."""
    from paged_serve.engine.model.loader import eos_token_ids, load_model

    refs: dict[tuple[str, bool], dict[str, dict[int, list[int]]]] = {}
    for dtype in sorted({s.hf_dtype for s in systems}):
        cpu = torch.device("cpu")
        model = load_model(model_path, dtype=getattr(torch, dtype), device=cpu).model
        suppress = llama_cpp_eog_ids(tokenizer, eos_token_ids(model, tokenizer))
        for rule in sorted({s.suppress_eog for s in systems if s.hf_dtype == dtype}):
            started = time.perf_counter()
            # Without EOG, greedy's choices are the same as with it until it picks an EOG
            # token: a reference free of them serves both rules.
            plain = refs.get((dtype, False), {})
            refs[(dtype, rule)] = {}
            for w in workloads:
                known = plain.get(w.name, {}) if rule else {}
                reuse = {i: r for i, r in known.items() if not set(r) & set(suppress)}
                todo = [i for i in sample_indices(w.num_requests, k) if i not in reuse]
                fresh = hf_references(model, w, todo, suppress if rule else ())
                refs[(dtype, rule)][w.name] = {**reuse, **fresh}
            print(
                f"HF {dtype} references{' (EOG suppressed)' if rule else ''}: "
                f"{time.perf_counter() - started:.1f} s",
                flush=True,
            )
        del model
    return refs


def run_checks(
    server: Server,
    system: System,
    workloads: Sequence[ServingWorkload],
    tokenizer: Any,
    references: dict[str, dict[int, list[int]]],
) -> dict[str, CheckResult]:
    results = {}
    model = asyncio.run(_model_id(server.base_url))
    for w in workloads:
        replies = asyncio.run(complete_all(server.base_url, model, w))
        results[w.name] = check_replies(
            w,
            replies,
            tokenizer=tokenizer,
            references=references.get(w.name, {}),
            hf_dtype=system.hf_dtype,
            require_hf_equality=system.require_hf_equality,
        )
        print(f"  check {system.name} {w.name}: {results[w.name].summary()}", flush=True)
    return results


async def _model_id(base_url: str) -> str:
    async with new_session() as session:
        return await served_model(session, base_url)


# ----------------------------------------------------------------------------- timing
def timed_run(
    base_url: str,
    workload: ServingWorkload,
    rate: float,
    seed: int,
    sampling: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], list]:
    """Warm up, then one timed run of ``workload`` (greedy, or with ``sampling``'s fields);
    its metrics and records."""
    model = asyncio.run(_model_id(base_url))
    warmup = ServingWorkload(
        "warm-up",
        [p[:WARMUP_PROMPT_TOKENS] for p in (workload.prompts[0], workload.prompts[-1])],
        [WARMUP_MAX_TOKENS] * 2,
    )
    asyncio.run(complete_all(base_url, model, warmup))
    if workload.streams is not None:
        records, wall = asyncio.run(
            run_closed_loop(base_url, model, workload, workload.streams, sampling)
        )
    else:
        offsets = arrival_offsets(workload.num_requests, rate, seed)
        records, wall = asyncio.run(run_open_loop(base_url, model, workload, offsets, sampling))
    return summarize(records, wall), records


SPEC_COUNTER = re.compile(
    r"^paged_serve_spec_decode_num_(drafts|draft_tokens|accepted_tokens)_total (\S+)$", re.M
)


def speculation_counts(base_url: str) -> dict[str, int]:
    """paged-serve's speculative-decoding counters from ``/metrics`` (warm-up included):
    drafts, draft_tokens, accepted_tokens; empty when it does not speculate."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return {name: int(float(value)) for name, value in SPEC_COUNTER.findall(text)}


T = TypeVar("T")


def timing_order(
    systems: Sequence[T], workloads: Sequence[ServingWorkload], repeats: int
) -> list[tuple[int, ServingWorkload, T]]:
    """The timed runs as (repeat, workload, system), the systems taking turns within each
    repeat and workload: a noisy spell on a shared machine then falls on one run of each
    system rather than on every run of one, and the per-run ratios stay comparable."""
    return [(r, w, s) for r in range(repeats) for w in workloads for s in systems]


def run(args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    """Check and time every system on every workload; the report and whether all checks
    passed."""
    started, clock = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()), time.perf_counter()
    report: dict[str, Any] = {
        "bench": "perf.serving.bench_serving",
        "label": args.label,
        "started_utc": started,
        "source": source_revision(),
        "load_average_start": load_average(),
        "machine": machine(),
        "command": " ".join(["python -m perf.serving.bench_serving", *sys.argv[1:]]),
        "model": args.model or "the embedded SmolLM2-135M-Instruct",
    }
    print(
        f"commit {report['source']['commit']} ({report['source']['uncommitted_files']} "
        f"uncommitted files), load average {report['load_average_start']}, timed requests "
        f"{args.sampling or 'greedy'}",
        flush=True,
    )
    threads = args.threads or torch.get_num_threads()
    tokenizer = load_tokenizer(args.model)
    workloads = [WORKLOADS[name](tokenizer, args.num_requests, args.seed) for name in args.workload]
    report["workloads"] = {w.name: w.summary() for w in workloads}
    report["request_rate"] = None if math.isinf(args.request_rate) else args.request_rate
    report["sampling"] = args.sampling  # None: greedy timed runs
    references = {}
    if not args.no_check:
        references = compute_references(
            args.systems, workloads, tokenizer, args.check_requests, args.model
        )
    log_dir = args.out_dir / f"logs-{started}"
    report["checks"], report["runs"], report["servers"] = {}, [], {}
    all_passed = True

    def server(system: System) -> Server:
        return Server(
            system,
            log_path=log_dir / (re.sub(r"[^\w.-]+", "_", system.name) + ".log"),
            llama_slots=args.llama_slots,
            threads=threads,
        )

    timed: list[tuple[System, dict[str, CheckResult]]] = []  # the systems that passed
    for system in args.systems:
        report["servers"][system.name] = " ".join(server(system).command) or system.base_url
        checks: dict[str, CheckResult] = {}
        if not args.no_check:
            with server(system) as srv:
                print(f"  {system.name}: up in {srv.startup_s} s, checking", flush=True)
                checks = run_checks(
                    srv, system, workloads, tokenizer, references[reference_key(system)]
                )
            report["checks"][system.name] = {n: c.to_json() for n, c in checks.items()}
            if not all(c.passed for c in checks.values()):
                all_passed = False
                print(f"  {system.name}: check FAILED, not timed", flush=True)
                continue
        timed.append((system, checks))
    for repeat, w, (system, checks) in timing_order(timed, workloads, args.repeats):
        before = load_average()
        with server(system) as srv:
            metrics, _ = timed_run(srv.base_url, w, args.request_rate, args.seed, args.sampling)
            spec = speculation_counts(srv.base_url) if system.kind == "paged-serve" else None
        row = {
            "system": system.name,
            "workload": w.name,
            "repeat": repeat,
            "server_start_s": srv.startup_s,
            "load_average": {"before": before, "after": load_average()},
            "metrics": metrics,
            "check_summary": checks[w.name].summary() if w.name in checks else "",
            "speculation": spec,
        }
        report["runs"].append(row)
        print(
            f"  {system.name} {w.name} #{repeat}: {metrics['output_tok_s']} out tok/s, "
            f"ITL p50 {metrics['itl_ms']['p50']} ms, TTFT p50 {metrics['ttft_ms']['p50']}"
            f" ms, load {row['load_average']}",
            flush=True,
        )
    report["load_average_end"] = load_average()
    report["elapsed_s"] = round(time.perf_counter() - clock, 1)
    return report, all_passed


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report, passed = run(args)
    table = markdown_table(report["runs"])
    if args.repeats > 1:
        table += f"\n\nMedians over the {args.repeats} repeats:\n\n" + median_table(report["runs"])
    label = f" ({args.label})" if args.label else ""
    head = (
        f"perf.serving.bench_serving{label}, commit {report['source']['commit']}, load average "
        f"{report['load_average_start']} -> {report['load_average_end']}, "
        f"{report['elapsed_s']} s in all"
    )
    print(f"\n{head}\n\n{table}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"bench_serving-{report['started_utc']}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    stem.with_suffix(".md").write_text(f"{head}\n\n`{report['command']}`\n\n{table}\n")
    print(f"\nwrote {stem}.json and {stem}.md")
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
