"""KV-cache data movement benchmarks: ``write_kv`` (scatter new K/V) and ``copy_blocks`` (CoW).

Both are pure data movement, so the figure of merit is bandwidth: bytes read plus bytes written
(the same convention as the device copy bandwidth they are compared with), and the speed-up
over what one would write in PyTorch instead:

* ``write_kv``: ``T`` tokens of K and V (8 KV heads x 128, bf16: a Llama-3-8B / Qwen3 layer)
  scattered to random distinct slots of a large cache; baseline ``index_copy_`` into the flat
  cache views (``write_kv_ref`` masks the ``-1`` slots with a host sync, which a baseline
  should not be charged for). T = 1 and 16 are latency (read the microseconds); the largest T
  is the bandwidth case the target applies to.
* ``copy_blocks``: ``N`` (src, dst) block pairs over the engine's single
  ``[L, 2, num_blocks, 16, Hkv, D]`` allocation (Qwen3-0.6B: 28 layers, 8 x 128, bf16), one
  launch for all layers; baseline ``copy_blocks_ref`` (advanced-index gather + scatter).

Both run eagerly, as the engine calls them (the stream is pre-filled, so host launch time is
not counted). Inputs rotate over enough copies that every call starts with a cold L2. Each
kernel's result is checked exactly once before timing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch

from paged_serve.kernels.reference import copy_blocks_ref
from paged_serve.kernels.triton.block_copy import copy_blocks
from paged_serve.kernels.triton.kv_write import write_kv
from perf.kernels.cuda_timing import (
    CudaTimer,
    cold_copies,
    free_device_bytes,
    l2_cache_bytes,
    measure,
    run_with_benchmark,
)
from perf.kernels.report import PerfReport, Target

DTYPE = torch.bfloat16
DEVICE = "cuda"  # a module constant so the builders can be exercised on CPU tensors
BLOCK_SIZE = 16
KV_HEADS, HEAD_DIM = 8, 128
WRITE_TOKENS = (1, 16, 256, 4096, 65536)
COPY_LAYERS = 28
COPY_PAIRS = (1, 16, 256, 2048)
TARGET_PCT = 80.0
MEMORY_HEADROOM = 0.8


def is_target_case(test: str, params: dict[str, object]) -> bool:
    """The largest size of each, where the bandwidth target applies (run first)."""
    if test == "test_write_kv":
        return params.get("num_tokens") == max(WRITE_TOKENS)
    return test == "test_copy_blocks" and params.get("num_pairs") == max(COPY_PAIRS)


def _elem() -> int:
    return torch.finfo(DTYPE).bits // 8


def write_kv_bytes(num_tokens: int) -> int:
    """Bytes one ``write_kv`` call moves: K and V read and written, plus the slot ids."""
    return 2 * 2 * num_tokens * KV_HEADS * HEAD_DIM * _elem() + 8 * num_tokens


def copy_blocks_bytes(num_pairs: int) -> int:
    """Bytes one ``copy_blocks`` call moves: every (layer, side) block read and written."""
    block = BLOCK_SIZE * KV_HEADS * HEAD_DIM * _elem()
    return 2 * num_pairs * COPY_LAYERS * 2 * block + 16 * num_pairs


def build_write_inputs(copies: int, num_tokens: int) -> dict[str, torch.Tensor]:
    """K/V rows and distinct random slots for ``copies`` steps over one cache."""
    num_blocks = -(-copies * num_tokens // BLOCK_SIZE) + 1
    cache_shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=DEVICE)[: copies * num_tokens]
    return {
        "key": torch.randn(copies, num_tokens, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE),
        "value": torch.randn(copies, num_tokens, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE),
        "k_cache": torch.zeros(cache_shape, device=DEVICE, dtype=DTYPE),
        "v_cache": torch.zeros(cache_shape, device=DEVICE, dtype=DTYPE),
        "slots": slots.view(copies, num_tokens).contiguous(),
    }


def index_copy_write(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    slot_mapping: torch.Tensor,
) -> None:
    """The PyTorch way to scatter K/V rows to slots (no ``-1`` slots; no host sync)."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value)


def build_copy_inputs(copies: int, num_pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``[L, 2, num_blocks, 16, Hkv, D]`` cache and ``[copies, N, 2]`` (src, dst) pairs.

    Every block appears once over all copies' pairs, so destinations are distinct and never a
    source, and each copy touches its own blocks.
    """
    num_blocks = 2 * copies * num_pairs
    caches = torch.randn(
        COPY_LAYERS, 2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE
    )
    perm = torch.randperm(num_blocks, device=DEVICE).view(copies, 2, num_pairs)
    return caches, perm.transpose(1, 2).contiguous()  # [copies, N, 2]


def _fits(nbytes: float) -> bool:
    return nbytes <= MEMORY_HEADROOM * free_device_bytes()


def _report(
    perf_report: PerfReport,
    benchmark,
    *,
    section: str,
    title: str,
    case: str,
    nbytes: int,
    kernel_us: float,
    torch_us: float,
    copy_bandwidth_gbps: float,
    largest: bool,
) -> None:
    gbps = nbytes / (kernel_us * 1e-6) / 1e9
    metrics: dict[str, float | str | None] = {
        "kernel_us": kernel_us,
        "gbps": gbps,
        "copy_pct": 100 * gbps / copy_bandwidth_gbps,
        "torch_us": torch_us,
        "vs_torch_x": torch_us / kernel_us,
    }
    targets = []
    if largest:
        targets = [Target(f"{section} % of copy bandwidth", metrics["copy_pct"], TARGET_PCT, "%")]
    benchmark.extra_info.update(
        {"bytes": nbytes, **metrics, **{f"target_{t.name}": t.met for t in targets}}
    )
    perf_report.add(section, case, metrics, title=title, targets=targets)


@pytest.mark.parametrize("num_tokens", WRITE_TOKENS)
def test_write_kv(
    benchmark, perf_report: PerfReport, copy_bandwidth_gbps: float, num_tokens: int
) -> None:
    nbytes = write_kv_bytes(num_tokens)
    copies = cold_copies(nbytes, l2_bytes=l2_cache_bytes())
    x = build_write_inputs(copies, num_tokens)
    write_kv(x["key"][0], x["value"][0], x["k_cache"], x["v_cache"], slot_mapping=x["slots"][0])
    flat_k = x["k_cache"].view(-1, KV_HEADS, HEAD_DIM)
    flat_v = x["v_cache"].view(-1, KV_HEADS, HEAD_DIM)
    if not (
        torch.equal(flat_k[x["slots"][0]], x["key"][0])
        and torch.equal(flat_v[x["slots"][0]], x["value"][0])
    ):
        pytest.fail("write_kv did not write K/V exactly to their slots")

    def calls(fn: Callable[..., None]) -> list[Callable[[], None]]:
        return [
            functools.partial(
                fn,
                x["key"][i],
                x["value"][i],
                x["k_cache"],
                x["v_cache"],
                slot_mapping=x["slots"][i],
            )
            for i in range(copies)
        ]

    timer = CudaTimer(calls(write_kv), graph=False)
    kernel = run_with_benchmark(benchmark, timer)
    timer.release()
    baseline = measure(calls(index_copy_write), graph=False)
    benchmark.extra_info.update(
        {"num_tokens": num_tokens, **kernel.info("kernel"), **baseline.info("torch")}
    )
    _report(
        perf_report,
        benchmark,
        section="write_kv",
        title=f"KV write ({KV_HEADS} x {HEAD_DIM} bf16, random slots; vs index_copy_)",
        case=f"T={num_tokens}",
        nbytes=nbytes,
        kernel_us=kernel.median_us,
        torch_us=baseline.median_us,
        copy_bandwidth_gbps=copy_bandwidth_gbps,
        largest=num_tokens == max(WRITE_TOKENS),
    )


@pytest.mark.parametrize("num_pairs", COPY_PAIRS)
def test_copy_blocks(
    benchmark, perf_report: PerfReport, copy_bandwidth_gbps: float, num_pairs: int
) -> None:
    nbytes = copy_blocks_bytes(num_pairs)
    copies = cold_copies(nbytes, l2_bytes=l2_cache_bytes())
    block_bytes = BLOCK_SIZE * KV_HEADS * HEAD_DIM * _elem()
    cache_bytes = COPY_LAYERS * 2 * (2 * copies * num_pairs) * block_bytes
    if not _fits(cache_bytes * 1.1):
        pytest.skip(f"the cache would take {cache_bytes / 2**30:.1f} GiB: too large")
    caches, mapping = build_copy_inputs(copies, num_pairs)
    copy_blocks(caches, block_mapping=mapping[0])
    src, dst = mapping[0, :, 0], mapping[0, :, 1]
    # Layer by layer: a whole-cache gather of the copied blocks could take gigabytes.
    if not all(torch.equal(layer[:, dst], layer[:, src]) for layer in caches):
        pytest.fail("copy_blocks did not copy the blocks exactly")

    def calls(fn: Callable[..., None]) -> list[Callable[[], None]]:
        return [functools.partial(fn, caches, block_mapping=mapping[i]) for i in range(copies)]

    timer = CudaTimer(calls(copy_blocks), graph=False)
    kernel = run_with_benchmark(benchmark, timer)
    timer.release()
    baseline = measure(calls(copy_blocks_ref), graph=False)
    benchmark.extra_info.update(
        {"num_pairs": num_pairs, **kernel.info("kernel"), **baseline.info("torch")}
    )
    _report(
        perf_report,
        benchmark,
        section="copy_blocks",
        title=(
            f"block copy ({COPY_LAYERS} layers x K/V, block {BLOCK_SIZE} x {KV_HEADS} x "
            f"{HEAD_DIM} bf16; vs copy_blocks_ref)"
        ),
        case=f"N={num_pairs}",
        nbytes=nbytes,
        kernel_us=kernel.median_us,
        torch_us=baseline.median_us,
        copy_bandwidth_gbps=copy_bandwidth_gbps,
        largest=num_pairs == max(COPY_PAIRS),
    )
