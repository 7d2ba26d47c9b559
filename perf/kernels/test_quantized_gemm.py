"""Weight-only quantized GEMM benchmark at Llama-3.1-8B's and Qwen3-8B's projection shapes.

W4A16 with groups of 128 (GPTQ's and AWQ's usual setting, asymmetric uint8 zero points), bf16
activations, M = 1, 16, 64 and 256 rows. Reported: the kernel's time
(``paged_serve.kernels.triton.quantized_gemm.quantized_gemm``, eager, cold L2), GB/s over the
bytes one call must move (packed weights, scales, zeros, x and out) and that as a % of the
device's copy bandwidth (the decode rows are bandwidth-bound: the % is their figure of merit),
TFLOP/s over ``2 * M * N * K``, and the speed-up over torch's dequantize-then-matmul (the
reference's dequantization in torch, then ``F.linear`` in bf16: what runs without a kernel) and
over the dense bf16 ``F.linear`` a 16-bit checkpoint would run (the roof at large M). The
kernel's output is checked against ``reference.quantized_gemm_ref`` first.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from paged_serve.kernels.reference import dequantize_ref, pack_int_ref, quantized_gemm_ref
from paged_serve.kernels.triton.quantized_gemm import quantized_gemm
from perf.kernels.cuda_timing import (
    CudaTimer,
    cold_copies,
    l2_cache_bytes,
    measure,
    run_with_benchmark,
)
from perf.kernels.report import PerfReport

DEVICE = "cuda"
DTYPE = torch.bfloat16
BITS, GROUP_SIZE = 4, 128
ROWS = (1, 16, 64, 256)
# (name, N, K): the fused QKV and gate/up projections, o_proj, down_proj (hidden 4096, 32 query
# and 8 KV heads of 128; intermediate 14336 for Llama-3.1-8B, 12288 for Qwen3-8B).
SHAPES = (
    ("qkv", 6144, 4096),
    ("o_proj", 4096, 4096),
    ("llama_gate_up", 28672, 4096),
    ("llama_down", 4096, 14336),
    ("qwen3_gate_up", 24576, 4096),
    ("qwen3_down", 4096, 12288),
)


def make_weight(n: int, k: int, gen: torch.Generator):
    """``(qweight, scales, zeros)`` of a random W4 g128 weight on the device."""
    groups = k // GROUP_SIZE
    values = torch.randint(0, 1 << BITS, (k, n), device=DEVICE, generator=gen)
    scales = ((torch.rand(groups, n, device=DEVICE, generator=gen) + 0.5) / (8 * k**0.5)).to(DTYPE)
    zeros = torch.randint(0, 1 << BITS, (groups, n), device=DEVICE, generator=gen)
    return pack_int_ref(values, BITS), scales, zeros.to(torch.uint8)


def dequantize_then_matmul(x, qweight, scales, zeros) -> torch.Tensor:
    """Without a kernel: the weight dequantized in torch each call, then a bf16 GEMM."""
    w = dequantize_ref(qweight, scales, zeros, bits=BITS, group_size=GROUP_SIZE)
    return F.linear(x, w.to(DTYPE))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_quantized_gemm(
    benchmark, perf_report: PerfReport, copy_bandwidth_gbps: float, shape, rows: int
) -> None:
    name, n, k = shape
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    groups = k // GROUP_SIZE
    io_bytes = k * n * BITS // 8 + groups * n * (2 + 1) + rows * (k + n) * 2
    copies = cold_copies(io_bytes, l2_bytes=l2_cache_bytes())
    inputs = []
    for _ in range(copies):
        x = torch.randn(rows, k, device=DEVICE, generator=gen).to(DTYPE)
        inputs.append((x, *make_weight(n, k, gen)))
    quant = dict(bits=BITS, group_size=GROUP_SIZE)
    x, qweight, scales, zeros = inputs[0]
    want = quantized_gemm_ref(x, qweight, scales, zeros, **quant)
    got = quantized_gemm(x, qweight, scales, zeros, **quant)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)

    calls = [functools.partial(quantized_gemm, *args, **quant) for args in inputs]
    timer = CudaTimer(calls, graph=False)
    kernel = run_with_benchmark(benchmark, timer)
    timer.release()
    baseline = measure([functools.partial(dequantize_then_matmul, *a) for a in inputs], graph=False)
    dense_w = dequantize_ref(qweight, scales, zeros, **quant).to(DTYPE)
    dense = measure([functools.partial(F.linear, x, dense_w)], graph=False)
    del dense_w

    seconds = kernel.median_us * 1e-6
    gbps = io_bytes / seconds / 1e9
    metrics: dict[str, float | str | None] = {
        "kernel_us": kernel.median_us,
        "gbps": gbps,
        "copy_pct": 100 * gbps / copy_bandwidth_gbps,
        "tflops": 2 * rows * n * k / seconds / 1e12,
        "dequant_matmul_us": baseline.median_us,
        "vs_dequant_x": baseline.median_us / kernel.median_us,
        "dense_bf16_us": dense.median_us,
        "vs_dense_x": dense.median_us / kernel.median_us,
    }
    benchmark.extra_info.update({"shape": name, "n": n, "k": k, "rows": rows, **metrics})
    perf_report.add(
        "quantized_gemm",
        f"{name} {n}x{k} M={rows}",
        metrics,
        title=f"W{BITS}A16 GEMM (g{GROUP_SIZE}, uint8 zeros, bf16 x; vs dequantize + F.linear)",
    )
