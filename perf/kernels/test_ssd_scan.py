"""Mamba-2 scan benchmarks at two released hybrids' Mamba-2 layer shapes.

``SHAPES`` (heads H of P lanes, G groups of B and C with N lanes each, one rank): Granite 4.0
H Small's and Nemotron-H 8B's mixers as their ``config.json`` files give them (written down from
the published checkpoints; this machine cannot reach the hub to re-read them). bf16 inputs, fp32
dt, A and D, fp32 states in a pool of twice as many slots as sequences, each sequence on a
shuffled slot:

* **decode** (the recurrent kernel), batch {1, 16, 128}: one token per sequence. GB/s over the
  state read and written plus x, dt, B, C and y, as a % of the device's copy bandwidth, and the
  speed-up over the same step in torch (gather the states, update, read out, scatter back);
  both in CUDA graphs.
* **prefill** (the chunked kernel), one sequence of {1024, 8192, 32768} tokens: tokens/s and
  the speed-up over the CPU engine's chunked torch form (``engine/platform/cpu/ssm.py``'s
  ``ssd_scan_cpu``) run eagerly on the GPU.

Each kernel's output and final state are first checked against the torch code's (bf16
tolerances for y).
"""

from __future__ import annotations

import functools

import pytest
import torch

from paged_serve.engine.platform.cpu.ssm import ssd_scan_cpu
from paged_serve.kernels.triton.ssd_scan import ssd_scan
from perf.kernels.cuda_timing import CudaTimer, measure, run_with_benchmark
from perf.kernels.report import PerfReport

DEVICE = "cuda"
DTYPE = torch.bfloat16
# (H, G, P, N) per model
SHAPES = {"granite-4.0-h-small": (128, 1, 64, 128), "nemotron-h-8b": (128, 8, 64, 128)}
BATCHES = (1, 16, 128)
CONTEXTS = (1024, 8192, 32768)
ATOL = RTOL = 3e-2
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _inputs(
    shape: tuple[int, int, int, int], tokens: int, slots: int, gen: torch.Generator
) -> tuple[torch.Tensor, ...]:
    """x, dt, A, B, C, D, state; dt and A in trained Mamba-2's ranges (dt * A in [-1.6, 0))."""
    H, G, P, N = shape

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=DEVICE, generator=gen)

    x = randn(tokens, H, P).to(DTYPE)
    B, C = (randn(tokens, G, N).to(DTYPE) for _ in range(2))
    dt = torch.rand(tokens, H, device=DEVICE, generator=gen) * 0.1 + 1e-3
    A = -(1 + torch.rand(H, device=DEVICE, generator=gen) * 15)
    D = randn(H)
    state = randn(slots, H, P, N) * 0.1
    return x, dt, A, B, C, D, state


def _torch_decode(x, dt, A, B, C, D, state, slots) -> torch.Tensor:
    """One token per sequence in torch ops, graph-capturable: gather, update, scatter."""
    S = state[slots]  # [b, H, P, N]
    group = x.shape[1] // B.shape[1]
    b, c = (t.float().repeat_interleave(group, dim=1) for t in (B, C))
    xf = x.float()
    S = S * (dt * A).exp()[..., None, None] + (dt[..., None] * xf)[..., None] * b[:, :, None]
    state[slots] = S
    return ((S @ c[..., None]).squeeze(-1) + D[:, None] * xf).to(x.dtype)


@pytest.mark.parametrize("model", sorted(SHAPES))
@pytest.mark.parametrize("batch", BATCHES)
def test_ssd_scan_decode(
    benchmark, perf_report: PerfReport, copy_bandwidth_gbps: float, batch: int, model: str
) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    H, G, P, N = SHAPES[model]
    x, dt, A, B, C, D, state = _inputs(SHAPES[model], batch, 2 * batch, gen)
    slots = torch.randperm(2 * batch, device=DEVICE, generator=gen)[:batch].to(torch.int32)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
    has = torch.ones(batch, dtype=torch.int32, device=DEVICE)
    work, torch_work = state.clone(), state.clone()
    kernel_call = functools.partial(
        ssd_scan, x, dt, A, B, C, D, work, cu_seqlens=cu, state_slots=slots, has_state=has,
        max_seqlen_q=1,
    )  # fmt: skip
    torch_call = functools.partial(_torch_decode, x, dt, A, B, C, D, torch_work, slots.long())
    torch.testing.assert_close(kernel_call().float(), torch_call().float(), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(work, torch_work, atol=1e-4, rtol=1e-4)
    metrics: dict[str, float | str | None] = {
        "torch_us": measure([torch_call], graph=True).median_us
    }
    timer = CudaTimer([kernel_call], graph=True)
    kernel = run_with_benchmark(benchmark, timer)
    timer.release()
    t = kernel.median_us
    io_bytes = batch * (2 * H * P * N * 4 + (2 * H * P + 2 * G * N) * 2 + H * 4)
    gbps = io_bytes / (t * 1e-6) / 1e9
    metrics.update(
        {
            "kernel_us": t,
            "gbps": gbps,
            "copy_pct": 100 * gbps / copy_bandwidth_gbps,
            "vs_torch_x": metrics["torch_us"] / t,
        }
    )
    benchmark.extra_info.update({"batch": batch, "model": model, **metrics})
    perf_report.add(
        "ssd_scan_decode",
        f"{model} B={batch}",
        metrics,
        title="Mamba-2 scan decode (bf16 in, fp32 state; recurrent kernel and torch's "
        "gather/update/scatter in CUDA graphs)",
    )


@pytest.mark.parametrize("model", sorted(SHAPES))
@pytest.mark.parametrize("context", CONTEXTS)
def test_ssd_scan_prefill(benchmark, perf_report: PerfReport, context: int, model: str) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x, dt, A, B, C, D, state = _inputs(SHAPES[model], context, 2, gen)
    meta = dict(
        cu_seqlens=torch.tensor([0, context], dtype=torch.int32, device=DEVICE),
        state_slots=torch.ones(1, dtype=torch.int32, device=DEVICE),
        has_state=torch.zeros(1, dtype=torch.int32, device=DEVICE),
        max_seqlen_q=context,
    )
    work, torch_work = state.clone(), state.clone()
    kernel_call = functools.partial(ssd_scan, x, dt, A, B, C, D, work, **meta)
    torch_call = functools.partial(ssd_scan_cpu, x, dt, A, B, C, D, torch_work, **meta)
    torch.testing.assert_close(kernel_call().float(), torch_call().float(), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(work, torch_work, atol=1e-2, rtol=1e-2)  # TF32 dots
    metrics: dict[str, float | str | None] = {
        "torch_us": measure([torch_call], graph=False, host_syncs=True).median_us
    }
    timer = CudaTimer([kernel_call], graph=False)
    kernel = run_with_benchmark(benchmark, timer)
    timer.release()
    t = kernel.median_us
    metrics.update(
        {"kernel_us": t, "mtok_per_s": context / t, "vs_torch_x": metrics["torch_us"] / t}
    )
    benchmark.extra_info.update({"context": context, "model": model, **metrics})
    perf_report.add(
        "ssd_scan_prefill",
        f"{model} T={context}",
        metrics,
        title="Mamba-2 scan prefill, one sequence (bf16 in; chunked kernel against the CPU "
        "engine's chunked torch form on the GPU)",
    )
