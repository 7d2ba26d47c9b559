"""The fp32 projections' kernels on this CPU: ``F.linear`` and each few-row kernel of
engine/platform/cpu/linears.py forced in turn over the default model's projection shapes, and
the ones the engine would choose.

``python -m perf.cpu.bench_linears [--rows 1 2 3 4 8] [--layers 30]`` builds ``--layers`` layers of
random fp32 weights with SmolLM2-135M's fused projection shapes (q/k/v 960x576, o 576x576, gate/up
3072x576, down 576x1536; about 14 MB a layer, so 30 layers stream from memory, not cache) and times
one pass of ``rows`` rows through all of them per kernel (``linear``: ``F.linear`` on the plain
weights; ``columns``: the split over the cores; ``packed``: oneDNN's packed copy), median of
``--passes`` after a warm-up. It reports ms a pass and GB/s of weights read, then the kernels
``choose_few_row_kernels`` picks at load. Timing belongs here, never in tests.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from paged_serve.engine.platform.cpu import linears
from paged_serve.engine.platform.cpu.linears import FEW_ROW_KERNELS, FEW_ROWS, Fp32Linear

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in) per fused projection


def build(layers: int) -> list[Fp32Linear]:
    """``layers`` x ``SHAPES`` random fp32 projections, over torch's threads."""
    torch.manual_seed(0)
    blocks = torch.get_num_threads()
    return [
        Fp32Linear(nn.Linear(k, n, bias=False).requires_grad_(False), blocks)
        for _ in range(layers)
        for n, k in SHAPES
    ]


@torch.inference_mode()
def _linear_pass_ms(modules: list[Fp32Linear], _kernel: str, inputs: dict) -> float:
    """ms of one pass of ``F.linear`` over the modules' plain weights."""
    start = time.perf_counter()
    for m in modules:
        F.linear(inputs[m.in_features], m.weight)
    return 1e3 * (time.perf_counter() - start)


def cpu_name() -> str:
    """The CPU's model name (Linux), else what ``platform`` knows."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m perf.cpu.bench_linears", description=__doc__)
    p.add_argument("--rows", nargs="+", type=int, default=[1, 2, 3, 4, 8])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--passes", type=int, default=15)
    args = p.parse_args(argv)
    modules = build(args.layers)
    megabytes = sum(m.weight.numel() * 4 for m in modules) / 1e6
    rows_out = []
    for rows in args.rows:
        row: dict[str, object] = {"rows": rows}
        inputs = {m.in_features: torch.randn(rows, m.in_features) for m in modules}
        for kernel in ("linear", *FEW_ROW_KERNELS):
            run = _linear_pass_ms if kernel == "linear" else linears.pass_ms
            times = [run(modules, kernel, inputs) for _ in range(1 + args.passes)]
            ms = statistics.median(times[1:])  # the first warms up
            row[f"{kernel}_ms"] = round(ms, 2)
            row[f"{kernel}_gb_s"] = round(megabytes / ms, 1)
        rows_out.append(row)
    timings = linears.choose_few_row_kernels(modules)
    result = {
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "weights_mb": round(megabytes, 1),
        "rows": rows_out,
        "chosen": dict(zip(range(1, FEW_ROWS + 1), modules[0].few_row_kernels)),
        "choice_ms": {
            rows: {k: round(ms, 2) for k, ms in per_kernel.items()}
            for rows, per_kernel in timings.items()
        },
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
