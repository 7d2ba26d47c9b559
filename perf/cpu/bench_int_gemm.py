"""The 4-bit CPU product (kernels/cpu/int_gemm.py) against what torch offers, at decode row counts.

``python -m perf.cpu.bench_int_gemm [--rows 1 4 8 16] [--bits 4] [--group-size 128]`` times, per
projection shape of SmolLM2-135M (fused q/k/v 960x576, o 576x576, gate/up 3072x576, down
576x1536) and of a 1.5B model (Qwen2.5-1.5B: q/k/v 2048x1536, o 1536x1536, gate/up 17920x1536,
down 1536x8960), and per row count, one product of:

* ``int_gemm``: our kernel on the tiled codes (random codes, groups of ``--group-size``, or
  of 64 where that does not divide K: SmolLM2's 576 inputs);
* ``fp32``: ``F.linear`` on an unquantized fp32 weight of the same shape;
* ``dequant``: torch's path for a ``PackedInt`` (``QuantizedLinear``'s: dequantize, then
  ``F.linear``), what the CPU ran before the kernel;
* ``int4pack``: ``aten._weight_int4pack_mm_for_cpu`` with bf16 activations (4-bit only);
* ``floor``: the kernel's bytes (codes, scales, zeros) over the memory bandwidth, measured as a
  large torch copy (bytes read and written over its time).

Each method cycles through enough copies of its weight that a pass reads at least
``--stream-mb`` MB (so weights come from memory, not cache, as in a decode step over all layers);
a time is the best of ``--passes`` passes over the copies, divided by their count (best, not
median: on a shared machine the noise only ever adds). Prints a table of microseconds a product
and the ratios to ``int_gemm``. Timing belongs here, never in tests.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from paged_serve.engine.config import cache_root
from paged_serve.engine.platform.cpu.host_malloc import keep_freed_memory
from paged_serve.engine.quant.weights import packed_int
from paged_serve.kernels.cpu import int_gemm
from perf.cpu.bench_linears import cpu_name

SHAPES = {  # (name, out, in)
    "SmolLM2-135M": (("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576),
                     ("down", 576, 1536)),
    "1.5B": (("qkv", 2048, 1536), ("o", 1536, 1536), ("gate_up", 17920, 1536),
             ("down", 1536, 8960)),
}  # fmt: skip
METHODS = ("int_gemm", "fp32", "dequant", "int4pack")


def copy_bandwidth_gb_s(megabytes: int = 512, passes: int = 5) -> float:
    """GB/s of a large torch copy, counting bytes read and written (the best of ``passes``)."""
    src = torch.ones(megabytes << 18)  # fp32: 4 bytes an element
    dst = torch.empty_like(src)
    best = min(_seconds(lambda: dst.copy_(src)) for _ in range(passes))
    return 2 * src.numel() * 4 / best / 1e9


def _seconds(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _best_us(calls: list[Callable[[], object]], passes: int) -> float:
    """Microseconds a call: the best pass over ``calls`` (one warm-up pass first)."""
    for call in calls:
        call()
    best = min(_seconds(lambda: [c() for c in calls]) for _ in range(passes))
    return 1e6 * best / len(calls)


def _int4pack_mm(x: torch.Tensor, weight: torch.Tensor, group: int, scale_offset: torch.Tensor):
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight, group, scale_offset)


def _copies(nbytes: int, stream_mb: int) -> int:
    return max(1, -(-(stream_mb << 20) // nbytes))


def time_shape(n: int, k: int, rows: list[int], args: argparse.Namespace, kernel) -> list[dict]:
    """One row of results per row count for the ``[n, k]`` projection."""
    torch.manual_seed(0)
    bits = args.bits
    size = next(g for g in (args.group_size, 64, 32) if k % g == 0)  # 576 inputs: groups of 64
    groups = k // size
    codes = torch.randint(0, 1 << bits, (k, n))
    scales = torch.rand(groups, n) * 0.01
    packed = packed_int(codes, scales, None, bits=bits, group_size=size)
    tiled = int_gemm.repack(packed.qweight, packed.scales, None, bits=bits, group_size=size)
    tiled_list = [
        int_gemm.repack(packed.qweight.clone(), scales, None, bits=bits, group_size=size)
        for _ in range(_copies(tiled.nbytes, args.stream_mb))
    ]
    fp32 = [torch.randn(n, k) for _ in range(_copies(n * k * 4, args.stream_mb))]
    int4 = []
    if bits == 4:
        scale_offset = torch.stack([scales, torch.zeros_like(scales)], -1).bfloat16()
        int4_weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes.t().contiguous().to(torch.int32), 1
        )
        int4 = [
            (int4_weight.clone(), scale_offset.clone())
            for _ in range(
                _copies(int4_weight.numel() * int4_weight.element_size(), args.stream_mb)
            )
        ]
    results = []
    for m in rows:
        x = torch.randn(m, k)
        xb = x.bfloat16()
        ours = [lambda x=x, t=t: kernel.matmul(x, t) for t in tiled_list]
        us = {
            "int_gemm": _best_us(ours, args.passes),
            "fp32": _best_us([lambda x=x, w=w: F.linear(x, w) for w in fp32], args.passes),
            "dequant": _best_us([lambda x=x: F.linear(x, packed.dequantize())], 2),
        }
        if int4:
            calls = [lambda x=xb, w=w, so=so: _int4pack_mm(x, w, size, so) for w, so in int4]
            us["int4pack"] = _best_us(calls, args.passes)
        results.append({"rows": m, "bytes": tiled.nbytes, "group": size, **us})
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m perf.cpu.bench_int_gemm", description=__doc__)
    p.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8, 16])
    p.add_argument("--bits", type=int, choices=(4, 8), default=4)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--passes", type=int, default=7)
    p.add_argument("--stream-mb", type=int, default=64)
    p.add_argument("--models", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    args = p.parse_args(argv)
    keep_freed_memory()  # as the engine does: no page faults on each call's temporaries
    kernel = int_gemm.load(cache_root())
    if kernel is None:
        print("the C kernel did not build here (see the warning above)")
        return 1
    bandwidth = copy_bandwidth_gb_s()
    print(f"cpu: {cpu_name()}  threads: {torch.get_num_threads()}  torch: {torch.__version__}")
    print(f"{args.bits}-bit, g: group size; copy bandwidth {bandwidth:.1f} GB/s")
    header = (
        f"{'model':<13}{'proj':<8}{'N x K':>12}{'g':>4}{'M':>4}{'int_gemm':>10}{'GB/s':>6}"
        f"{'floor':>8}{'fp32':>9}{'x':>6}{'dequant':>10}{'x':>7}{'int4pack':>10}{'x':>6}"
    )
    print(header + "\n" + "-" * len(header))
    for model in args.models:
        for name, n, k in SHAPES[model]:
            for r in time_shape(n, k, args.rows, args, kernel):
                ours = r["int_gemm"]
                floor = r["bytes"] / bandwidth / 1e3
                line = (
                    f"{model:<13}{name:<8}{f'{n}x{k}':>12}{r['group']:>4}{r['rows']:>4}{ours:>10.0f}"
                    f"{r['bytes'] / ours / 1e3:>6.1f}{floor:>8.0f}{r['fp32']:>9.0f}"
                    f"{r['fp32'] / ours:>6.1f}{r['dequant']:>10.0f}{r['dequant'] / ours:>7.0f}"
                )
                if "int4pack" in r:
                    line += f"{r['int4pack']:>10.0f}{r['int4pack'] / ours:>6.1f}"
                print(line)
    print("us a product (best pass); x: that method's time over int_gemm's; floor: bytes / copy")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
