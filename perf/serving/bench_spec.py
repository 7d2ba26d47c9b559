"""Speculative decoding through the server: output tokens/s with and without it, and against
llama.cpp's server with its own n-gram drafting, on the same weights and prompts.

    python -m perf.serving.bench_spec [--dtype float32 --dtype bfloat16] [--repeats 3]
        [--no-llama-cpp] [--workload copy-heavy-1 ...] [--out-dir /tmp/bench_spec]

Workloads (``perf.serving.workloads``): ``copy-heavy-1``/``-4`` (prompts that hold most of
their answer, 1 or 4 streams) and ``decode-heavy-1``/``-4`` (the decode-heavy mix, 1 or 4
streams). Systems, per dtype: paged-serve with ``--no-speculation`` and as it starts by default
(prompt lookup on the CPU), and in float32 ``llama-cpp-f32`` with and without its n-gram
drafting (``LLAMA_NGRAM_ARGS``; ``python -m perf.serving.llama_cpp build`` first, or
``--no-llama-cpp``).

It is ``perf.serving.bench_serving`` underneath: each system's greedy tokens checked first
(paged-serve in float32 must equal Hugging Face fp32 with speculation on, as without), then the
timed runs taking turns, every run on a fresh server. It prints bench_serving's tables, then one
line per workload and dtype: the median output tok/s of each system, the ratio of speculation to
none, the ratio to llama.cpp with n-gram drafting, and the acceptance paged-serve's ``/metrics``
reported (accepted / drafted tokens, and tokens per drafting step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from perf.serving import bench_serving

WORKLOADS = ("copy-heavy-1", "copy-heavy-4", "decode-heavy-1", "decode-heavy-4")
# llama-server's draft-free n-gram speculation with its own defaults (`llama-server --help`:
# a 12-token lookup n-gram, drafts of up to 48 tokens).
LLAMA_NGRAM_ARGS = ("--spec-type", "ngram-simple")


def systems(dtypes: Sequence[str], llama_cpp: bool) -> list[str]:
    """The ``--system`` values of the run: per dtype paged-serve without speculation and with
    its default (``"auto"``: prompt lookup on the CPU, ``SpeculativeConfig()``'s settings)."""
    out = []
    for dtype in dtypes:
        out += [f"paged-serve:{dtype} --no-speculation", f"paged-serve:{dtype}"]
    if llama_cpp:
        out += ["llama-cpp-f32", " ".join(["llama-cpp-f32", *LLAMA_NGRAM_ARGS])]
    return out


def ratios(runs: Sequence[dict[str, Any]], dtypes: Sequence[str]) -> list[str]:
    """One markdown line per workload and dtype (see the module docstring)."""

    def median(system: str, workload: str) -> float | None:
        values = [
            r["metrics"]["output_tok_s"]
            for r in runs
            if r["system"] == system and r["workload"] == workload
        ]
        return statistics.median(values) if values else None

    def counts(system: str, workload: str) -> dict[str, int]:
        total: dict[str, int] = {}
        for r in runs:
            if r["system"] == system and r["workload"] == workload and r.get("speculation"):
                for key, value in r["speculation"].items():
                    total[key] = total.get(key, 0) + value
        return total

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.2f}x" if a and b else "not measured"

    names = {r["system"] for r in runs}
    lines = [
        "| workload | dtype | no spec tok/s | spec tok/s | spec / none | llama.cpp n-gram tok/s "
        "| spec / llama.cpp n-gram | llama.cpp plain tok/s | accepted / drafted | tokens per "
        "drafting step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    llama_plain = "llama-cpp-f32"
    llama_ngram = next((n for n in names if n.startswith("llama-cpp-f32 ")), None)
    for workload in dict.fromkeys(r["workload"] for r in runs):
        for dtype in dtypes:
            none = next((n for n in names if n == f"paged-serve-{dtype} --no-speculation"), None)
            spec = f"paged-serve-{dtype}"
            a, b = median(spec, workload), median(none, workload)
            c = median(llama_ngram, workload) if llama_ngram and dtype == "float32" else None
            d = median(llama_plain, workload) if dtype == "float32" else None
            n = counts(spec, workload)
            rate = (
                f"{n['accepted_tokens'] / n['draft_tokens']:.2f}" if n.get("draft_tokens") else "-"
            )
            per_step = f"{1 + n['accepted_tokens'] / n['drafts']:.2f}" if n.get("drafts") else "-"
            cells = [workload, dtype, b, a, ratio(a, b), c, ratio(a, c), d, rate, per_step]
            lines.append("| " + " | ".join("-" if x is None else str(x) for x in cells) + " |")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", action="append", default=None, help="default float32, bfloat16")
    p.add_argument("--workload", action="append", default=None, choices=WORKLOADS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-llama-cpp", action="store_true")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--out-dir", type=Path, default=Path("/tmp/bench_spec"))
    args = p.parse_args(argv)
    dtypes = args.dtype or ["float32", "bfloat16"]
    forwarded = [f"--system={s}" for s in systems(dtypes, not args.no_llama_cpp)]
    forwarded += [f"--workload={w}" for w in args.workload or WORKLOADS]
    forwarded += [f"--repeats={args.repeats}", f"--out-dir={args.out_dir}", "--label=bench_spec"]
    forwarded += ["--no-check"] if args.no_check else []
    serving_args = bench_serving.parse_args(forwarded)
    report, passed = bench_serving.run(serving_args)
    report["command"] = " ".join(["python -m perf.serving.bench_spec", *sys.argv[1:]])
    table = bench_serving.median_table(report["runs"])
    summary = "\n".join(ratios(report["runs"], dtypes))
    head = (
        f"perf.serving.bench_spec, commit {report['source']['commit']}, load average "
        f"{report['load_average_start']} -> {report['load_average_end']}, "
        f"{report['elapsed_s']} s in all"
    )
    print(f"\n{head}\n\n{table}\n\n{summary}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"bench_spec-{report['started_utc']}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    stem.with_suffix(".md").write_text(f"{head}\n\n`{report['command']}`\n\n{table}\n\n{summary}\n")
    print(f"\nwrote {stem}.json and {stem}.md")
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
