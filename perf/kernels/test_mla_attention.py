"""MLA decode benchmark at DeepSeek-V3's layer shape: absorbed queries over a paged latent cache.

128 query heads (one tensor-parallel rank holding all of them), latent 512 + rope 64 lanes per
token, bf16, block size 64, each sequence's blocks shuffled over the whole cache; batch {1, 16,
128} x context {1024, 8192, 32768} (B = 128 x 32768 is skipped where it does not fit). Reported:
the kernel's time (CUDA graph, the split-KV factor ``mla_launch`` picks), GB/s over the latent
bytes read plus q and out, that as a % of the device's copy bandwidth, and the speed-up over
``torch.nn.functional.scaled_dot_product_attention`` on the same absorbed problem laid out
contiguously (q ``[B, 128, 1, 576]``, keys ``[B, 1, ctx, 576]``, values their first 512 lanes,
``enable_gqa=True``; CUDA graph): what a user without a paged MLA kernel would run. The kernel's
output is checked against SDPA's first (bf16 tolerances).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from paged_serve.kernels.triton.mla_attention import (
    MlaShapes,
    mla_attention,
    mla_launch,
    mla_workspace_numel,
)
from perf.kernels.cuda_timing import CudaTimer, free_device_bytes, measure, run_with_benchmark
from perf.kernels.report import PerfReport

DEVICE = "cuda"
DTYPE = torch.bfloat16
HEADS, LATENT, ROPE, BLOCK_SIZE = 128, 512, 64, 64
BATCHES = (1, 16, 128)
CONTEXTS = (1024, 8192, 32768)
ATOL = RTOL = 2e-2
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("batch", BATCHES)
def test_mla_decode(
    benchmark, perf_report: PerfReport, copy_bandwidth_gbps: float, batch: int, context: int
) -> None:
    width = LATENT + ROPE
    cache_bytes = batch * context * width * 2
    if 3 * cache_bytes > 0.8 * free_device_bytes():  # paged, contiguous copy, SDPA's scratch
        pytest.skip(f"needs {3 * cache_bytes / 2**30:.1f} GiB")
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    cache = torch.randn(num_blocks, BLOCK_SIZE, width, device=DEVICE, generator=gen).to(DTYPE)
    tables = torch.randperm(num_blocks, device=DEVICE, generator=gen).to(torch.int32)
    tables = tables.view(batch, blocks_per_seq)
    q = (torch.randn(batch, HEADS, width, device=DEVICE, generator=gen) / 4).to(DTYPE)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
    scale = (128 + 64) ** -0.5  # DeepSeek-V3's qk_head_dim
    shapes = MlaShapes(batch, HEADS, LATENT, ROPE, BLOCK_SIZE, batch)
    launch = mla_launch(
        shapes, dtype=DTYPE, max_seqlen_q=1, max_seqlen_k=context, num_kv_splits=None,
        num_sms=torch.cuda.get_device_properties(0).multi_processor_count,
    )  # fmt: skip
    workspace = torch.empty(
        mla_workspace_numel(
            num_tokens=batch, num_heads=HEADS, kv_lora_rank=LATENT,
            num_kv_splits=launch.num_kv_splits,
        ),
        dtype=torch.float32,
        device=DEVICE,
    )  # fmt: skip
    kernel_call = functools.partial(
        mla_attention, q, cache, block_tables=tables, seq_lens=seq_lens, cu_seqlens_q=cu,
        scale=scale, kv_lora_rank=LATENT, max_seqlen_q=1, max_seqlen_k=context,
        num_kv_splits=launch.num_kv_splits, workspace=workspace,
    )  # fmt: skip

    dense = cache[tables.long()].reshape(batch, 1, -1, width)[:, :, :context]  # [B, 1, ctx, C]
    q_sdpa = q.unsqueeze(2)  # [B, H, 1, C]
    values = dense[..., :LATENT]

    def sdpa_call() -> torch.Tensor:
        return F.scaled_dot_product_attention(q_sdpa, dense, values, scale=scale, enable_gqa=True)

    torch.testing.assert_close(
        kernel_call().float(), sdpa_call().squeeze(2).float(), atol=ATOL, rtol=RTOL
    )
    timer = CudaTimer([kernel_call], graph=True)
    kernel = run_with_benchmark(benchmark, timer)
    timer.release()
    sdpa = measure([sdpa_call], graph=True)
    io_bytes = cache_bytes + batch * HEADS * (width + LATENT) * 2
    t = kernel.median_us
    gbps = io_bytes / (t * 1e-6) / 1e9
    metrics: dict[str, float | str | None] = {
        "kernel_us": t,
        "gbps": gbps,
        "copy_pct": 100 * gbps / copy_bandwidth_gbps,
        "sdpa_us": sdpa.median_us,
        "vs_sdpa_x": sdpa.median_us / t,
        "splits": float(launch.num_kv_splits),
    }
    benchmark.extra_info.update({"batch": batch, "context": context, **metrics})
    perf_report.add(
        "mla_decode",
        f"B={batch} ctx={context}",
        metrics,
        title=f"MLA decode (DeepSeek-V3: {HEADS} heads, {LATENT}+{ROPE} latent, bf16, block "
        f"{BLOCK_SIZE}; kernel and SDPA in CUDA graphs)",
    )
