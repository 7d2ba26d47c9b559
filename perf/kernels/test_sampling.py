"""Fused sampling benchmark: ``paged_serve.kernels.triton.sampling.sample`` against the PyTorch
sort-based pipeline.

Batch {1, 8, 64, 256} x vocabulary {49152 (SmolLM2), 151936 (Qwen)} x filter mixes (top-k,
top-p, min-p, all three), fp32 logits (both vocabularies take the split-row kernel: 12 and 38
programs per row), temperature 0.8, a seed per row. The kernel runs in a
CUDA graph, as an engine's decode step would. The baseline is what one writes in PyTorch
(:func:`torch_sampling_pipeline`): softmax, sort, cumsum, mask, multinomial -- skipping the
sort when no row uses top-k or top-p, as vLLM's sampler does. It runs eagerly, as written
(``torch.multinomial`` validates its input on the host, which also keeps it out of CUDA graphs),
and its host time counts, as it would in an engine using it.

Before timing, every row's token from each side is checked to lie in the reference keep set
(``reference.sampling_keep_mask``), so both do the same job.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch

from paged_serve.kernels.reference import sampling_keep_mask
from paged_serve.kernels.triton.sampling import sample
from perf.kernels.cuda_timing import (
    CudaTimer,
    cold_copies,
    l2_cache_bytes,
    measure,
    run_with_benchmark,
)
from perf.kernels.report import PerfReport, Target

DEVICE = "cuda"  # a module constant so the builders can be exercised on CPU tensors
BATCHES = (1, 8, 64, 256)
VOCABS = (49152, 151936)
MIXES = {  # name -> (top_k, top_p, min_p), the same for every row
    "top_k=50": (50, 1.0, 0.0),
    "top_p=0.9": (0, 0.9, 0.0),
    "min_p=0.05": (0, 1.0, 0.05),
    "k50+p0.9+minp0.05": (50, 0.9, 0.05),
}
TEMPERATURE = 0.8
LOGIT_SCALE = 3.0
TARGET = (256, 151936, 5.0)  # batch, vocab, speed-up goal over the PyTorch pipeline


def is_target_case(test: str, params: dict[str, object]) -> bool:
    """The sampling shape the target is set on (``perf/conftest.py`` runs it first)."""
    return test == "test_sample" and (params.get("batch"), params.get("vocab")) == TARGET[:2]


def sampling_params(batch: int, mix: str) -> dict[str, torch.Tensor]:
    """Per-row parameters in the dtypes ``sample`` takes."""
    top_k, top_p, min_p = MIXES[mix]
    return {
        "temperature": torch.full((batch,), TEMPERATURE, device=DEVICE),
        "top_k": torch.full((batch,), top_k, dtype=torch.int32, device=DEVICE),
        "top_p": torch.full((batch,), top_p, device=DEVICE),
        "min_p": torch.full((batch,), min_p, device=DEVICE),
    }


def torch_sampling_pipeline(
    logits: torch.Tensor,
    *,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    use_top_k: bool,
    use_top_p: bool,
    use_min_p: bool,
) -> torch.Tensor:
    """Softmax, sort, cumsum, mask, multinomial; returns one token id per row.

    The keep rule is ``reference.sampling_keep_mask``'s (up to ties): top-k by rank, nucleus
    on the top-k-renormalised mass (mass ranked above a token ``< top_p * mass(top-k)``),
    min-p against the largest probability. ``use_*`` say which filters any row uses (host-side
    knowledge, like an engine's sampling metadata).
    """
    vocab = logits.shape[-1]
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    if not (use_top_k or use_top_p):
        if use_min_p:
            floor = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < floor, 0.0)
        return torch.multinomial(probs, 1).squeeze(1)
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    drop = torch.zeros_like(sorted_p, dtype=torch.bool)
    if use_top_k:
        k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
        drop |= rank >= k[:, None]
        sorted_p = sorted_p.masked_fill(drop, 0.0)
    if use_top_p:
        cumulative = torch.cumsum(sorted_p, dim=-1)
        drop |= cumulative - sorted_p >= top_p[:, None] * cumulative[:, -1:]
    if use_min_p:
        drop |= sorted_p < min_p[:, None] * sorted_p[:, :1]
    choice = torch.multinomial(sorted_p.masked_fill(drop, 0.0), 1)
    return order.gather(1, choice).squeeze(1)


def _filters_used(params: dict[str, torch.Tensor], vocab: int) -> dict[str, bool]:
    k = params["top_k"]
    return {
        "use_top_k": bool(((k > 0) & (k < vocab)).any()),
        "use_top_p": bool((params["top_p"] < 1.0).any()),
        "use_min_p": bool((params["min_p"] > 0.0).any()),
    }


def _check_in_keep_set(
    name: str, tokens: torch.Tensor, logits: torch.Tensor, params: dict[str, torch.Tensor]
) -> None:
    keep, _ = sampling_keep_mask(logits, **params)
    if not bool(keep.gather(1, tokens.view(-1, 1).long()).all()):
        pytest.fail(f"{name} drew a token outside the reference keep set")


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("batch", BATCHES)
def test_sample(benchmark, perf_report: PerfReport, batch: int, vocab: int, mix: str) -> None:
    nbytes = batch * vocab * 4
    copies = cold_copies(nbytes, l2_bytes=l2_cache_bytes())
    logits = torch.randn(copies, batch, vocab, device=DEVICE) * LOGIT_SCALE
    params = sampling_params(batch, mix)
    seeds = torch.arange(batch, dtype=torch.int64, device=DEVICE)
    steps = torch.zeros(batch, dtype=torch.int64, device=DEVICE)
    kernel_calls: list[Callable[[], object]] = [
        functools.partial(sample, logits[i], seeds=seeds, steps=steps, **params)
        for i in range(copies)
    ]
    torch_calls: list[Callable[[], object]] = [
        functools.partial(
            torch_sampling_pipeline, logits[i], **params, **_filters_used(params, vocab)
        )
        for i in range(copies)
    ]
    _check_in_keep_set("sample", kernel_calls[0]()[0], logits[0], params)
    _check_in_keep_set("torch pipeline", torch_calls[0](), logits[0], params)

    timer = CudaTimer(kernel_calls, graph=True)
    kernel = run_with_benchmark(benchmark, timer)
    timer.release()
    baseline = measure(torch_calls, graph=False, host_syncs=True)

    t = kernel.median_us
    metrics: dict[str, float | str | None] = {
        "kernel_us": t,
        "logits_gbps": nbytes / (t * 1e-6) / 1e9,
        "torch_us": baseline.median_us,
        "vs_torch_x": baseline.median_us / t,
    }
    targets = []
    if (batch, vocab) == TARGET[:2]:
        targets = [
            Target(f"sampling vs PyTorch pipeline ({mix})", metrics["vs_torch_x"], TARGET[2], "x")
        ]
    benchmark.extra_info.update(
        {
            "batch": batch,
            "vocab": vocab,
            "mix": mix,
            **metrics,
            **kernel.info("kernel"),
            **baseline.info("torch"),
            **{f"target_{x.name}": x.met for x in targets},
        }
    )
    perf_report.add(
        "sampling",
        f"B={batch} V={vocab} {mix}",
        metrics,
        title=(
            "fused sampling (fp32 logits; kernel in a CUDA graph; PyTorch pipeline eager; "
            "logits_gbps = logits bytes / time, one pass)"
        ),
        targets=targets,
    )
