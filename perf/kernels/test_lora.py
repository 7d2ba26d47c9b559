"""Batched multi-LoRA benchmark: shrink then expand at a 4096-wide projection, 16 adapters.

K = N = 4096 (Llama-3.1-8B's o_proj), rank 16, 16 adapters in their slots, bf16. Decode: T = 32
tokens, each of a random adapter (captured in a CUDA graph, as the engine runs decode steps);
prefill: T = 2048 tokens in 16 runs of 128, one adapter per run (eager). Reported: the time of
``lora_shrink`` + ``lora_expand`` (``paged_serve.kernels.triton.lora``), each alone, GB/s over
the bytes one pair of calls must move (x, the used adapters' A and B once, s written and read,
y read and written) and that as a % of the device's copy bandwidth (the decode rows are
bandwidth-bound), and the speed-up over torch's per-adapter loop (two bf16 matmuls and an
``index_add_`` per adapter in use, the tokens already grouped by slot outside the timing: the
loop's best case). The kernels' update is checked against ``reference.lora_shrink_ref`` and
``lora_expand_ref`` first.
"""

from __future__ import annotations

import functools

import pytest
import torch

from paged_serve.kernels.reference import lora_expand_ref, lora_shrink_ref
from paged_serve.kernels.triton.lora import lora_expand, lora_shrink
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
K = N = 4096
RANK, SLOTS = 16, 16
# (name, tokens, graph): decode steps are replayed from a CUDA graph, prefill runs eagerly
CASES = (("decode", 32, True), ("prefill", 2048, False))
PREFILL_RUN = 128  # prefill tokens per request (one adapter each)


def make_slots(tokens: int, gen: torch.Generator) -> torch.Tensor:
    """Decode: a random adapter per token; prefill: runs of ``PREFILL_RUN`` tokens per adapter."""
    if tokens <= 64:
        slots = torch.randint(0, SLOTS, (tokens,), device=DEVICE, generator=gen)
    else:
        slots = (torch.arange(tokens, device=DEVICE) // PREFILL_RUN) % SLOTS
    return slots.to(torch.int32)


def make_inputs(tokens: int, gen: torch.Generator):
    """``(x, a, b, slots, y)`` on the device, sized like trained adapters."""
    x = torch.randn(tokens, K, device=DEVICE, generator=gen).to(DTYPE)
    a = (torch.randn(SLOTS, RANK, K, device=DEVICE, generator=gen) / K**0.5).to(DTYPE)
    b = (torch.randn(SLOTS, RANK, N, device=DEVICE, generator=gen) / RANK**0.5).to(DTYPE)
    y = torch.randn(tokens, N, device=DEVICE, generator=gen).to(DTYPE)
    return x, a, b, make_slots(tokens, gen), y


def kernels(x, a, b, slots, y, s) -> None:
    lora_expand(lora_shrink(x, a, slots, out=s), b, slots, y)


def torch_loop(x, a, b, groups, y) -> None:
    """Per adapter in use: its tokens through A, then B, added into y (bf16 matmuls)."""
    for slot, rows in groups:
        y.index_add_(0, rows, (x[rows] @ a[slot].t()) @ b[slot])


def tokens_by_slot(slots: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    return [(int(slot), torch.nonzero(slots == slot).flatten()) for slot in slots.unique()]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_lora(benchmark, perf_report: PerfReport, copy_bandwidth_gbps: float, case) -> None:
    name, tokens, graph = case
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    inputs = [make_inputs(tokens, gen)]
    used = inputs[0][3].unique().numel()
    io_bytes = (
        tokens * K * 2  # x
        + used * RANK * (K + N) * 2  # the used adapters' A and B
        + 2 * tokens * RANK * 4  # s written, then read
        + 2 * tokens * N * 2  # y read and written
    )
    copies = cold_copies(io_bytes, l2_bytes=l2_cache_bytes())
    inputs += [make_inputs(tokens, gen) for _ in range(copies - 1)]
    scratch = [torch.empty(tokens, RANK, device=DEVICE) for _ in range(copies)]

    x, a, b, slots, y = inputs[0]
    want = y.clone()
    lora_expand_ref(lora_shrink_ref(x, a, slots), b, slots, want)
    got = y.clone()
    kernels(x, a, b, slots, got, scratch[0])
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)

    calls = [functools.partial(kernels, *args, s) for args, s in zip(inputs, scratch)]
    timer = CudaTimer(calls, graph=graph)
    kernel = run_with_benchmark(benchmark, timer)
    timer.release()
    pairs = list(zip(inputs, scratch))
    shrink = measure(
        [functools.partial(lora_shrink, i[0], i[1], i[3], out=s) for i, s in pairs], graph=graph
    )
    expand = measure(
        [functools.partial(lora_expand, s, i[2], i[3], i[4]) for i, s in pairs], graph=graph
    )
    loops = [
        functools.partial(torch_loop, x, a, b, tokens_by_slot(sl), y) for x, a, b, sl, y in inputs
    ]
    baseline = measure(loops, graph=graph)

    seconds = kernel.median_us * 1e-6
    gbps = io_bytes / seconds / 1e9
    metrics: dict[str, float | str | None] = {
        "kernel_us": kernel.median_us,
        "shrink_us": shrink.median_us,
        "expand_us": expand.median_us,
        "gbps": gbps,
        "copy_pct": 100 * gbps / copy_bandwidth_gbps,
        "torch_loop_us": baseline.median_us,
        "vs_loop_x": baseline.median_us / kernel.median_us,
        "adapters_used": used,
        "graph": "yes" if kernel.graph else "no",
    }
    benchmark.extra_info.update({"case": name, "tokens": tokens, **metrics})
    perf_report.add(
        "lora",
        f"{name} T={tokens}",
        metrics,
        title=(
            f"multi-LoRA shrink + expand ({SLOTS} adapters, rank {RANK}, {K} -> {N} bf16; "
            "vs a per-adapter torch loop)"
        ),
    )
