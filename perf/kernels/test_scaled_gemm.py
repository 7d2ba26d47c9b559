"""W8A8 GEMM benchmark (FP8 and int8 checkpoint weights) at 4B-8B models' projection shapes.

Schemes: e4m3 weights with 128 x 128 block scales (DeepSeek's and Qwen3's "fine-grained FP8")
and with channel scales, int8 weights with channel scales; bf16 activations, M = 1 and 16
(decode) and 512 and 2048 (prefill). Reported: the call's time
(``paged_serve.kernels.triton.scaled_gemm.fp8_gemm`` / ``int8_gemm``, eager, cold L2: the
activations' quantization kernel and the GEMM), GB/s over the bytes one call must move (the
8-bit weight, its scales, x, the codes written and read, out) and that as a % of the device's
copy bandwidth (the decode rows' figure of merit), TFLOP/s over ``2 * M * N * K``, and the
speed-up over torch's dequantize-then-matmul in bf16 (what ran before this kernel), over the
dense bf16 ``F.linear`` a 16-bit checkpoint would run, and over ``torch._scaled_mm`` (fp8,
row-wise scales; block scales where this torch takes them) or ``torch._int_mm`` (int8) on
activations quantized beforehand, i.e. torch's 8-bit GEMM alone (None where torch refuses the
shape or scheme). The kernel's output is checked against the reference first.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from paged_serve.kernels.reference import (
    dequantize_fp8_ref,
    fp8_gemm_ref,
    int8_gemm_ref,
    quantize_fp8_rows_ref,
    quantize_int8_rows_ref,
)
from paged_serve.kernels.triton.scaled_gemm import fp8_gemm, int8_gemm
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
BLOCK = (128, 128)
ROWS = (1, 16, 512, 2048)
SCHEMES = ("fp8-block", "fp8-channel", "int8-channel")
# (name, N, K): Llama-3.1-8B's and Qwen3-8B's fused QKV, o_proj, gate/up and down (hidden
# 4096), Qwen3-4B's (hidden 2560, 32 query and 8 KV heads of 128, intermediate 9728).
SHAPES = (
    ("qkv", 6144, 4096),
    ("o_proj", 4096, 4096),
    ("llama_gate_up", 28672, 4096),
    ("llama_down", 4096, 14336),
    ("qwen3_4b_qkv", 6144, 2560),
    ("qwen3_4b_gate_up", 19456, 2560),
    ("qwen3_4b_down", 2560, 9728),
)


def make_weight(scheme: str, n: int, k: int, gen: torch.Generator):
    """``(weight [N, K], scale, block_size)`` of a random 8-bit weight on the device; outputs
    come out near unit size."""
    unit = 1 / (64 * k**0.5)
    if scheme == "int8-channel":
        weight = torch.randint(-127, 128, (n, k), device=DEVICE, generator=gen, dtype=torch.int8)
        return weight, (torch.rand(n, device=DEVICE, generator=gen) + 0.5) * unit, None
    weight = (torch.randn(n, k, device=DEVICE, generator=gen) * 64).to(torch.float8_e4m3fn)
    if scheme == "fp8-channel":
        return weight, (torch.rand(n, device=DEVICE, generator=gen) + 0.5) * unit, None
    shape = (-(-n // BLOCK[0]), -(-k // BLOCK[1]))
    return weight, (torch.rand(shape, device=DEVICE, generator=gen) + 0.5) * unit, BLOCK


def kernel_call(x, weight, scale, block):
    if weight.dtype == torch.int8:
        return int8_gemm(x, weight, scale)
    return fp8_gemm(x, weight, scale, block_size=block)


def reference(x, weight, scale, block):
    if weight.dtype == torch.int8:
        return int8_gemm_ref(x, weight, scale)
    return fp8_gemm_ref(x, weight, scale, block_size=block)


def dequantized(weight, scale, block) -> torch.Tensor:
    if weight.dtype == torch.int8:
        return weight.float() * scale[:, None]
    return dequantize_fp8_ref(weight, scale, block_size=block)


def dequantize_then_matmul(x, weight, scale, block) -> torch.Tensor:
    """Without a kernel: the weight dequantized in torch each call, then a bf16 GEMM."""
    return F.linear(x, dequantized(weight, scale, block).to(DTYPE))


def torch_8bit_gemm(x, weight, scale, block):
    """torch's own 8-bit GEMM on ``x`` quantized beforehand, as a zero-argument call, or
    ``(None, why)`` where this torch or device refuses it."""
    try:
        if weight.dtype == torch.int8:
            codes, a_scale = quantize_int8_rows_ref(x)

            def call():
                return (torch._int_mm(codes, weight.t()) * a_scale * scale).to(DTYPE)

        else:
            codes, a_scale = quantize_fp8_rows_ref(
                x, group_size=None if block is None else block[1]
            )
            w_t = weight.t()
            b_scale = scale[None, :] if block is None else scale.t()

            def call():
                return torch._scaled_mm(
                    codes, w_t, scale_a=a_scale, scale_b=b_scale, out_dtype=DTYPE
                )

        call()
        torch.cuda.synchronize()
        return call, None
    except (RuntimeError, ValueError, NotImplementedError) as exc:
        return None, f"{type(exc).__name__}: {exc}"[:120]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_scaled_gemm(
    benchmark, perf_report: PerfReport, copy_bandwidth_gbps: float, scheme, shape, rows: int
) -> None:
    name, n, k = shape
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    weight, scale, block = make_weight(scheme, n, k, gen)
    io_bytes = n * k + scale.numel() * 4 + rows * k * (2 + 2) + rows * n * 2
    copies = cold_copies(io_bytes, l2_bytes=l2_cache_bytes())
    inputs = [(torch.randn(rows, k, device=DEVICE, generator=gen).to(DTYPE), weight, scale)]
    for _ in range(copies - 1):
        x = torch.randn(rows, k, device=DEVICE, generator=gen).to(DTYPE)
        inputs.append((x, *make_weight(scheme, n, k, gen)[:2]))
    x = inputs[0][0]
    want = reference(x, weight, scale, block)
    got = kernel_call(x, weight, scale, block)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)

    timer = CudaTimer([functools.partial(kernel_call, *a, block) for a in inputs], graph=False)
    kernel = run_with_benchmark(benchmark, timer)
    timer.release()
    baseline = measure(
        [functools.partial(dequantize_then_matmul, *a, block) for a in inputs], graph=False
    )
    dense_w = dequantized(weight, scale, block).to(DTYPE)
    dense = measure([functools.partial(F.linear, x, dense_w)], graph=False)
    del dense_w
    torch_call, torch_note = torch_8bit_gemm(x, weight, scale, block)
    torch_us = measure([torch_call], graph=False).median_us if torch_call else None

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
        "torch_8bit_us": torch_us,
        "vs_torch_8bit_x": None if torch_us is None else torch_us / kernel.median_us,
        "torch_8bit_note": torch_note,
    }
    benchmark.extra_info.update({"shape": name, "n": n, "k": k, "rows": rows, **metrics})
    perf_report.add(
        f"scaled_gemm {scheme}",
        f"{name} {n}x{k} M={rows}",
        metrics,
        title=f"W8A8 GEMM {scheme} (bf16 x quantized per call; vs dequantize + F.linear, "
        "dense bf16, torch's 8-bit GEMM on pre-quantized x)",
    )
