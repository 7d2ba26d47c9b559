"""Gated delta rule benchmarks at Qwen3-Next's linear-attention layer shape.

16 key heads and 32 value heads of 128 lanes (one tensor-parallel rank holding all of them),
bf16 inputs, fp32 states in a pool of twice as many slots as sequences, each sequence on a
shuffled slot:

* **decode** (the recurrent kernel), batch {1, 16, 128}: one token per sequence. GB/s over the
  state read and written plus q, k, v and out, as a % of the device's copy bandwidth, and the
  speed-up over transformers' own torch fallback (``torch_recurrent_gated_delta_rule``, what HF
  runs without flash-linear-attention) on the states gathered contiguously; both in CUDA
  graphs.
* **prefill** (the chunked kernel), one sequence of {1024, 8192, 32768} tokens: tokens/s and
  the speed-up over transformers' ``torch_chunk_gated_delta_rule`` (eager: it loops over chunks
  on the host).

Each kernel's output is first checked against the torch function's (bf16 tolerances).
"""

from __future__ import annotations

import functools

import pytest
import torch

from paged_serve.kernels.triton.delta_rule import gated_delta_rule
from perf.kernels.cuda_timing import CudaTimer, measure, run_with_benchmark
from perf.kernels.report import PerfReport

DEVICE = "cuda"
DTYPE = torch.bfloat16
HK, HV, DK, DV = 16, 32, 128, 128
BATCHES = (1, 16, 128)
CONTEXTS = (1024, 8192, 32768)
ATOL = RTOL = 3e-2
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

try:
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )
except ImportError:  # an older transformers: the kernel's figures only
    torch_chunk_gated_delta_rule = torch_recurrent_gated_delta_rule = None


def _inputs(tokens: int, slots: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=DEVICE, generator=gen)

    q, k = randn(tokens, HK, DK).to(DTYPE), randn(tokens, HK, DK).to(DTYPE)
    v = randn(tokens, HV, DV).to(DTYPE)
    g = -torch.rand(tokens, HV, device=DEVICE, generator=gen) * 2
    beta = torch.rand(tokens, HV, device=DEVICE, generator=gen)
    state = randn(slots, HV, DK, DV) * 0.1
    return q, k, v, g, beta, state


@pytest.mark.parametrize("batch", BATCHES)
def test_delta_rule_decode(
    benchmark, perf_report: PerfReport, copy_bandwidth_gbps: float, batch: int
) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v, g, beta, state = _inputs(batch, 2 * batch, gen)
    slots = torch.randperm(2 * batch, device=DEVICE, generator=gen)[:batch].to(torch.int32)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
    has = torch.ones(batch, dtype=torch.int32, device=DEVICE)
    work = state.clone()
    kernel_call = functools.partial(
        gated_delta_rule, q, k, v, g, beta, work, cu_seqlens=cu, state_slots=slots,
        has_state=has, max_seqlen_q=1,
    )  # fmt: skip
    metrics: dict[str, float | str | None] = {}
    if torch_recurrent_gated_delta_rule is not None:
        gathered = state[slots.long()].clone()

        def torch_call() -> torch.Tensor:
            out, _ = torch_recurrent_gated_delta_rule(
                q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
                initial_state=gathered, output_final_state=True, use_qk_l2norm_in_kernel=True,
            )  # fmt: skip
            return out[:, 0]

        torch.testing.assert_close(
            kernel_call().float(), torch_call().float(), atol=ATOL, rtol=RTOL
        )
        metrics["torch_us"] = measure([torch_call], graph=True).median_us
    timer = CudaTimer([kernel_call], graph=True)
    kernel = run_with_benchmark(benchmark, timer)
    timer.release()
    t = kernel.median_us
    io_bytes = batch * (2 * HV * DK * DV * 4 + (2 * HK * DK + 2 * HV * DV) * 2 + 2 * HV * 4)
    gbps = io_bytes / (t * 1e-6) / 1e9
    metrics.update({"kernel_us": t, "gbps": gbps, "copy_pct": 100 * gbps / copy_bandwidth_gbps})
    if "torch_us" in metrics:
        metrics["vs_torch_x"] = metrics["torch_us"] / t
    benchmark.extra_info.update({"batch": batch, **metrics})
    perf_report.add(
        "delta_rule_decode",
        f"B={batch}",
        metrics,
        title=f"Gated delta rule decode (Qwen3-Next: {HK}/{HV} heads x {DK}, bf16 in, fp32 "
        "state; recurrent kernel and HF's torch fallback in CUDA graphs)",
    )


@pytest.mark.parametrize("context", CONTEXTS)
def test_delta_rule_prefill(benchmark, perf_report: PerfReport, context: int) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v, g, beta, state = _inputs(context, 2, gen)
    cu = torch.tensor([0, context], dtype=torch.int32, device=DEVICE)
    slots = torch.ones(1, dtype=torch.int32, device=DEVICE)
    fresh = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    kernel_call = functools.partial(
        gated_delta_rule, q, k, v, g, beta, state, cu_seqlens=cu, state_slots=slots,
        has_state=fresh, max_seqlen_q=context,
    )  # fmt: skip
    metrics: dict[str, float | str | None] = {}
    if torch_chunk_gated_delta_rule is not None:

        def torch_call() -> torch.Tensor:
            out, _ = torch_chunk_gated_delta_rule(
                q[None], k[None], v[None], g[None], beta[None], output_final_state=True,
                use_qk_l2norm_in_kernel=True,
            )  # fmt: skip
            return out[0]

        torch.testing.assert_close(
            kernel_call().float(), torch_call().float(), atol=ATOL, rtol=RTOL
        )
        metrics["torch_us"] = measure([torch_call], graph=False).median_us
    timer = CudaTimer([kernel_call], graph=False)
    kernel = run_with_benchmark(benchmark, timer)
    timer.release()
    t = kernel.median_us
    metrics.update({"kernel_us": t, "mtok_per_s": context / t})
    if "torch_us" in metrics:
        metrics["vs_torch_x"] = metrics["torch_us"] / t
    benchmark.extra_info.update({"context": context, **metrics})
    perf_report.add(
        "delta_rule_prefill",
        f"T={context}",
        metrics,
        title=f"Gated delta rule prefill, one sequence (Qwen3-Next: {HK}/{HV} heads x {DK}, "
        "bf16 in; chunked kernel against HF's torch chunked fallback)",
    )
