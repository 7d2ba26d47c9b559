"""Fused mixture-of-experts benchmark at Qwen3-30B-A3B's layer shape.

128 experts, top-8, hidden 2048, expert width 768, bf16; T = 1, 16 and 256 tokens routed by
random router logits (softmax top-k, renormalised). Reported: the fused kernel's time
(``paged_serve.kernels.triton.fused_moe.fused_moe``: pair alignment, two grouped GEMMs, SwiGLU, the
sum; eager, as the engine runs a layer), TFLOP/s over the routed pairs' multiply-adds
(``2 * T * k * 3 * H * I``), GB/s over the expert weights the step reads (each chosen expert's
``3 * H * I`` weights once) plus activations, that as a % of the device's copy bandwidth, and
the speed-up over the per-expert torch loop a user would write (HF's eager experts: one
``F.linear`` pair per chosen expert). The kernel's output is checked against the loop's first.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

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
