"""Decode attention on the CPU: the C kernel (``kernels/cpu/decode_attention.py``) against the
torch path (the plan's gather and SDPA, ``engine/platform/cpu/attention.py``).

``python -m perf.cpu.bench_attention [--rows 1 8 24] [--contexts 128 512] [--rounds 9]``

One layer's decode attention for ``rows`` sequences of ``context`` cached tokens each, in
SmolLM2-135M's shape by default (9 query heads over 3 KV heads of 64, blocks of 16), fp32 and
bf16. As in the engine, each call reads the next of ``--layers`` layers' caches in one
allocation, so a layer's blocks are not in the CPU's caches from the call before. Both paths
run on the same inputs; the outputs are checked against each other (fp32 rounding, or one bf16
rounding) before anything is timed. Prints each path's median time per call over ``--rounds``
rounds of one call per layer, in us, and the ratio.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from pathlib import Path

import torch

from paged_serve.engine.config import cache_root
from paged_serve.engine.platform.cpu.attention import PlannedTorchAttention
from paged_serve.engine.platform.cpu.host_malloc import keep_freed_memory
from paged_serve.kernels.cpu import decode_attention as cpu_decode_attention
from paged_serve.kernels.cpu.decode_attention import CpuDecodeAttention
from perf.wall_timing import median_wall_s

TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2.0**-7}  # relative: fp32 sums, one bf16 rounding


class Case:
    """One layer shape's decode step over ``layers`` layers' caches, run by either path."""

    def __init__(self, args: argparse.Namespace, dtype: torch.dtype, rows: int, context: int):
        gen = torch.Generator().manual_seed(rows * 100_003 + context)
        q_heads, kv_heads = args.heads
        d, bs = args.head_dim, args.block_size
        per_seq = -(-context // bs)
        num_blocks = rows * per_seq + 1
        shape = (args.layers, 2, num_blocks, bs, kv_heads, d)
        self.caches = torch.randn(*shape, generator=gen).to(dtype)
        tables = torch.randperm(num_blocks, generator=gen)[: rows * per_seq].view(rows, per_seq)
        self.block_tables = tables.to(torch.int32)
        self.seq_lens = torch.full((rows,), context, dtype=torch.int32)
        self.cu_seqlens_q = torch.arange(rows + 1, dtype=torch.int32)
        self.q = torch.randn(rows, q_heads, d, generator=gen).to(dtype)
        self.scale = d**-0.5

    def gathered(self, planned: PlannedTorchAttention, layer: int) -> torch.Tensor:
        """The torch path: the plan's gather and SDPA."""
        k_cache, v_cache = self.caches[layer]
        return planned.paged_attention(
            self.q,
            k_cache,
            v_cache,
            block_tables=self.block_tables,
            seq_lens=self.seq_lens,
            cu_seqlens_q=self.cu_seqlens_q,
            scale=self.scale,
        )

    def every_layer(self, path: Callable[[object, int], torch.Tensor], runner: object) -> None:
        """One decode step's attention: ``path`` over each layer in turn."""
        for layer in range(self.caches.shape[0]):
            path(runner, layer)

    def in_place(self, kernel: CpuDecodeAttention, layer: int) -> torch.Tensor:
        """The C kernel, reading the cache in place."""
        k_cache, v_cache = self.caches[layer]
        return kernel.attend(
            self.q,
            k_cache,
            v_cache,
            block_tables=self.block_tables,
            seq_lens=self.seq_lens,
            scale=self.scale,
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 24])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--heads", type=int, nargs=2, default=[9, 3], metavar=("HQ", "HKV"))
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: the engine's")
    args = parser.parse_args(argv)
    keep_freed_memory()  # as the engine does on the CPU
    kernel = cpu_decode_attention.load(args.cache_dir or cache_root())
    if kernel is None:
        raise SystemExit("the C kernel did not build here (see the log line above)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, heads {args.heads}")
    print(f"{'dtype':>8} {'rows':>4} {'context':>7} {'torch us':>9} {'kernel us':>9} {'ratio':>6}")
    for dtype in (torch.float32, torch.bfloat16):
        for rows in args.rows:
            for context in args.contexts:
                case, planned = Case(args, dtype, rows, context), PlannedTorchAttention()
                want, got = case.gathered(planned, 0), case.in_place(kernel, 0)
                tol = TOLERANCE[dtype]
                if not torch.allclose(got.float(), want.float(), rtol=tol, atol=tol):
                    raise SystemExit(f"{dtype} rows {rows} context {context}: outputs differ")
                sweeps = (
                    functools.partial(case.every_layer, case.gathered, planned),
                    functools.partial(case.every_layer, case.in_place, kernel),
                )
                torch_s, kernel_s = (median_wall_s(sweep, args.rounds) for sweep in sweeps)
                torch_us, kernel_us = (1e6 * t / args.layers for t in (torch_s, kernel_s))
                name = str(dtype).removeprefix("torch.")
                print(
                    f"{name:>8} {rows:>4} {context:>7} {torch_us:>9.1f} {kernel_us:>9.1f} "
                    f"{torch_us / kernel_us:>5.2f}x"
                )


if __name__ == "__main__":
    main()
