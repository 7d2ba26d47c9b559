"""Fused mixture-of-experts benchmark at Qwen3-30B-A3B's layer shape.

128 experts, top-8, hidden 2048, expert width 768, bf16; T = 1, 16 and 256 tokens routed by
random router logits (softmax top-k, renormalised). Reported: the fused kernel's time
(``paged_serve.kernels.triton.fused_moe.fused_moe``: pair alignment, two grouped GEMMs, SwiGLU, the
sum; eager, as the engine runs a layer), TFLOP/s over the routed pairs' multiply-adds
(``2 * T * k * 3 * H * I``), GB/s over the expert weights the step reads (each chosen expert's
``3 * H * I`` weights once) plus activations, that as a % of the device's copy bandwidth, and
the speed-up over the per-expert torch loop a user would write (HF's eager experts: one
``F.linear`` pair per chosen expert). The kernel's output is checked against the loop's first.

Quantized experts (``test_fused_moe_quantized``), the same shape and routing: W4A16 with groups
of 128 and uint8 zero points (GPTQ's and AWQ's usual setting) and FP8 e4m3 with 128 x 128 block
scales (weight-only: bf16 activations), random codes and scales. Reported: the kernel's time
(each weight tile dequantized inside the tile, ``kernels/triton/quantized_moe.py``), GB/s over
the quantized bytes the chosen experts hold (codes, scales, zeros) plus activations and that as
a % of copy bandwidth, and the speed-up over the unquantized fused MoE on the dequantized bf16
experts (what a checkpoint dequantized at load runs, at 16-bit memory) and over dequantizing
every expert in torch each call, then the fused MoE (what runs without the kernel, at quantized
memory). The output is checked against the torch loop over the dequantized experts first.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

from paged_serve.kernels.interface import ExpertWeights, Fp8Experts, IntExperts
from paged_serve.kernels.reference import dequantize_experts_ref, pack_int_ref
from paged_serve.kernels.triton.fused_moe import fused_moe
from perf.kernels.cuda_timing import CudaTimer, measure, run_with_benchmark
from perf.kernels.report import PerfReport

DEVICE = "cuda"
DTYPE = torch.bfloat16
EXPERTS, TOP_K, HIDDEN, WIDTH = 128, 8, 2048, 768
TOKENS = (1, 16, 256)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def torch_loop(x, w1, w2, ids, weights) -> torch.Tensor:
    """HF's eager experts: one pair of ``F.linear`` per expert some token chose."""
    out = torch.zeros_like(x)
    for expert in ids.unique().tolist():
        token, slot = torch.where(ids == expert)
        y = F.linear(swiglu(F.linear(x[token], w1[expert])), w2[expert])
        out.index_add_(0, token, y * weights[token, slot, None])
    return out


@pytest.mark.parametrize("num_tokens", TOKENS)
def test_fused_moe(
    benchmark, perf_report: PerfReport, copy_bandwidth_gbps: float, num_tokens: int
) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(num_tokens, HIDDEN, device=DEVICE, generator=gen).to(DTYPE)
    w1 = (torch.randn(EXPERTS, 2 * WIDTH, HIDDEN, device=DEVICE, generator=gen) / 45).to(DTYPE)
    w2 = (torch.randn(EXPERTS, HIDDEN, WIDTH, device=DEVICE, generator=gen) / 28).to(DTYPE)
    logits = torch.randn(num_tokens, EXPERTS, device=DEVICE, generator=gen)
    weights, ids = torch.softmax(logits, dim=-1).topk(TOP_K, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(DTYPE)
    fused = functools.partial(fused_moe, x, w1, w2, ids, weights, apply_gate=swiglu)
    loop = functools.partial(torch_loop, x, w1, w2, ids, weights)
    torch.testing.assert_close(fused().float(), loop().float(), atol=3e-2, rtol=3e-2)
    timer = CudaTimer([fused], graph=False)
    kernel = run_with_benchmark(benchmark, timer)
    timer.release()
    baseline = measure([loop], graph=False, host_syncs=True)
    chosen = ids.unique().numel()
    weight_bytes = chosen * 3 * HIDDEN * WIDTH * 2
    act_bytes = num_tokens * TOP_K * (2 * WIDTH + HIDDEN) * 2 * 2 + num_tokens * HIDDEN * 2 * 2
    flops = 2 * num_tokens * TOP_K * 3 * HIDDEN * WIDTH
    seconds = kernel.median_us * 1e-6
    gbps = (weight_bytes + act_bytes) / seconds / 1e9
    metrics: dict[str, float | str | None] = {
        "kernel_us": kernel.median_us,
        "tflops": flops / seconds / 1e12,
        "gbps": gbps,
        "copy_pct": 100 * gbps / copy_bandwidth_gbps,
        "torch_loop_us": baseline.median_us,
        "vs_loop_x": baseline.median_us / kernel.median_us,
        "experts_chosen": chosen,
    }
    benchmark.extra_info.update({"num_tokens": num_tokens, **metrics})
    perf_report.add(
        "fused_moe",
        f"T={num_tokens}",
        metrics,
        title=f"fused MoE ({EXPERTS} experts, top-{TOP_K}, {HIDDEN} x {WIDTH} bf16; vs a loop)",
    )


GROUP_SIZE, FP8_BLOCK = 128, (128, 128)
LAYOUTS = ("int4-g128", "fp8-block128")


def quantized_experts(layout: str, n: int, k: int, gen: torch.Generator) -> ExpertWeights:
    """Random ``[EXPERTS, n, k]`` experts in ``layout``, scaled so the products stay O(1)."""
    if layout == "int4-g128":
        codes = torch.randint(0, 16, (EXPERTS, k, n), device=DEVICE, generator=gen)
        groups = k // GROUP_SIZE
        scales = (torch.rand(EXPERTS, groups, n, device=DEVICE, generator=gen) + 0.5) / (8 * k**0.5)
        zeros = torch.randint(0, 16, (EXPERTS, groups, n), device=DEVICE, generator=gen)
        qweight = torch.stack([pack_int_ref(c, 4) for c in codes])
        return IntExperts(qweight, scales, zeros.to(torch.uint8), bits=4, group_size=GROUP_SIZE)
    weight = torch.randn(EXPERTS, n, k, device=DEVICE, generator=gen).to(torch.float8_e4m3fn)
    blocks = (EXPERTS, -(-n // FP8_BLOCK[0]), -(-k // FP8_BLOCK[1]))
    scale = (torch.rand(blocks, device=DEVICE, generator=gen) + 0.5) / k**0.5
    return Fp8Experts(weight, scale, FP8_BLOCK)


def stored_bytes(weights: ExpertWeights, chosen: int) -> int:
    """The bytes ``chosen`` experts of ``weights`` hold (codes, scales, zeros)."""
    values = [getattr(weights, f.name) for f in dataclasses.fields(weights)]
    tensors = [t for t in values if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors) * chosen // EXPERTS


@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fused_moe_quantized(
    benchmark, perf_report: PerfReport, copy_bandwidth_gbps: float, layout: str, num_tokens: int
) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(num_tokens, HIDDEN, device=DEVICE, generator=gen).to(DTYPE)
    q1 = quantized_experts(layout, 2 * WIDTH, HIDDEN, gen)
    q2 = quantized_experts(layout, HIDDEN, WIDTH, gen)
    w1, w2 = dequantize_experts_ref(q1).to(DTYPE), dequantize_experts_ref(q2).to(DTYPE)
    logits = torch.randn(num_tokens, EXPERTS, device=DEVICE, generator=gen)
    weights, ids = torch.softmax(logits, dim=-1).topk(TOP_K, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(DTYPE)
    quantized = functools.partial(fused_moe, x, q1, q2, ids, weights, apply_gate=swiglu)
    dense = functools.partial(fused_moe, x, w1, w2, ids, weights, apply_gate=swiglu)

    def dequantize_then_fused() -> torch.Tensor:
        d1, d2 = dequantize_experts_ref(q1).to(DTYPE), dequantize_experts_ref(q2).to(DTYPE)
        return fused_moe(x, d1, d2, ids, weights, apply_gate=swiglu)

    loop = torch_loop(x, w1, w2, ids, weights)
    torch.testing.assert_close(quantized().float(), loop.float(), atol=3e-2, rtol=3e-2)
    timer = CudaTimer([quantized], graph=False)
    kernel = run_with_benchmark(benchmark, timer)
    timer.release()
    dense_time = measure([dense], graph=False)
    dequant_time = measure([dequantize_then_fused], graph=False)
    chosen = ids.unique().numel()
    weight_bytes = stored_bytes(q1, chosen) + stored_bytes(q2, chosen)
    act_bytes = num_tokens * TOP_K * (2 * WIDTH + HIDDEN) * 2 * 2 + num_tokens * HIDDEN * 2 * 2
    seconds = kernel.median_us * 1e-6
    gbps = (weight_bytes + act_bytes) / seconds / 1e9
    metrics: dict[str, float | str | None] = {
        "kernel_us": kernel.median_us,
        "tflops": 2 * num_tokens * TOP_K * 3 * HIDDEN * WIDTH / seconds / 1e12,
        "gbps": gbps,
        "copy_pct": 100 * gbps / copy_bandwidth_gbps,
        "dense_fused_us": dense_time.median_us,
        "vs_dense_x": dense_time.median_us / kernel.median_us,
        "dequant_then_fused_us": dequant_time.median_us,
        "vs_dequant_x": dequant_time.median_us / kernel.median_us,
        "experts_chosen": chosen,
    }
    benchmark.extra_info.update({"layout": layout, "num_tokens": num_tokens, **metrics})
    perf_report.add(
        "fused_moe_quantized",
        f"{layout} T={num_tokens}",
        metrics,
        title=(
            f"fused MoE, quantized experts ({EXPERTS} experts, top-{TOP_K}, {HIDDEN} x {WIDTH}, "
            "bf16 activations; vs dense and dequantize-then-fused)"
        ),
    )
