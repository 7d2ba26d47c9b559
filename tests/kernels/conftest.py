"""Kernel-test harness: interpreter switch, ``device`` fixture, ``cuda`` marker, paged-KV builder.

Without CUDA the kernels run under Triton's interpreter on CPU tensors. ``@triton.jit`` decides
between compiling and interpreting when a kernel module is *imported*, so TRITON_INTERPRET is
set here, before any test module imports ``kernels.*``; the check below fails loudly if a kernel
module was imported earlier without it (the tests would then launch real GPU kernels on CPU
tensors and die with an obscure error).

The interpreter reduces and scans in sequential order; a GPU does not (``gpu_order.py``). The
``interpreter_order`` fixture runs a test once per order; ``PAGED_SERVE_INTERPRETER_ORDER=tree``
runs every kernel test of the session in the GPU's tree order (CI does both).
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests.kernels.gpu_order import ORDERS  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
SESSION_ORDER = os.environ.get("PAGED_SERVE_INTERPRETER_ORDER", "sequential")
if SESSION_ORDER not in ORDERS:
    raise RuntimeError(f"PAGED_SERVE_INTERPRETER_ORDER must be in {ORDERS}, got {SESSION_ORDER}")
_HERE = Path(__file__).parent

for _name in (
    "paged_serve.kernels.triton.paged_attention",
    "paged_serve.kernels.triton.kv_write",
    "paged_serve.kernels.triton.block_copy",
    "paged_serve.kernels.triton.sampling",
    "paged_serve.kernels.triton.mla_attention",
    "paged_serve.kernels.triton.causal_conv",
    "paged_serve.kernels.triton.delta_rule",
    "paged_serve.kernels.triton.ssd_scan",
    "paged_serve.kernels.triton.quantized_moe",
    "paged_serve.kernels.triton.lora",
):
    _mod = sys.modules.get(_name)
    if _mod is not None and not HAS_CUDA and os.environ.get("TRITON_INTERPRET") == "1":
        _kernel_types = {type(v).__name__ for k, v in vars(_mod).items() if k.endswith("_kernel")}
        if _kernel_types != {"InterpretedFunction"}:
            raise RuntimeError(f"{_name} was imported before TRITON_INTERPRET=1 was set")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``@pytest.mark.cuda`` kernel tests (the large grids) when there is no GPU. In a
    session run in the tree order, deselect the tests that take ``interpreter_order``: they
    choose their order themselves and ran in both in the default session."""
    if SESSION_ORDER == "tree":
        chosen = [i for i in items if "interpreter_order" in getattr(i, "fixturenames", ())]
        if chosen:
            config.hook.pytest_deselected(items=chosen)
            items[:] = [i for i in items if i not in chosen]
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords and _HERE in Path(item.path).parents:
            item.add_marker(skip)


def _reduction_order(order: str):
    """The interpreter's reduction order for a block; a GPU runs its own, so nothing there."""
    if HAS_CUDA:
        return contextlib.nullcontext()
    from tests.kernels.gpu_order import reduction_order

    return reduction_order(order)


@pytest.fixture(autouse=True)
def _session_reduction_order():
    """Every kernel test runs in ``PAGED_SERVE_INTERPRETER_ORDER`` (default: sequential)."""
    with _reduction_order(SESSION_ORDER):
        yield


@pytest.fixture(params=ORDERS)
def interpreter_order(request: pytest.FixtureRequest):
    """Run the test in the interpreter's sequential order and in the GPU's tree order.

    A GPU runs its own order, so there the ``tree`` case is skipped.
    """
    if HAS_CUDA and request.param != "sequential":
        pytest.skip("a GPU reduces in its own order")
    with _reduction_order(request.param):
        yield request.param


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")


@dataclass(frozen=True)
class PagedBatch:
    """One attention step's inputs; every cache slot not holding a live token is NaN."""

    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32
    cu_seqlens_q: torch.Tensor  # [S + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int

    def kwargs(self) -> dict:
        return dict(
            block_tables=self.block_tables,
            seq_lens=self.seq_lens,
            cu_seqlens_q=self.cu_seqlens_q,
            max_seqlen_q=self.max_seqlen_q,
            max_seqlen_k=self.max_seqlen_k,
        )


def build_paged_batch(
    seqs: list[tuple[int, int]],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    spare_blocks: int = 3,
) -> PagedBatch:
    """Build a ragged step from ``seqs`` = [(q_len, context_len), ...].

    The token data depend only on ``seed`` and the shapes, not on ``block_size``, so the same
    batch can be laid out with different block sizes. Blocks are assigned in a random order
    (non-contiguous, non-monotonic tables); the tail of each last block, the spare blocks and
    the unused block-table entries (which point at a spare block) are all NaN.
    """
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(q for q, _ in seqs)
    q = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen)
    keys = [torch.randn(c, num_kv_heads, head_dim, generator=gen) for _, c in seqs]
    values = [torch.randn(c, num_kv_heads, head_dim, generator=gen) for _, c in seqs]

    blocks_per_seq = [-(-c // block_size) for _, c in seqs]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen)
    spare = int(order[-1])
    max_blocks = max(blocks_per_seq) + 1  # one more column than needed: unused entries exist
    block_tables = torch.full((len(seqs), max_blocks), spare, dtype=torch.int32)
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    next_block = 0
    for s, (_, ctx) in enumerate(seqs):
        for j in range(blocks_per_seq[s]):
            block = int(order[next_block])
            next_block += 1
            block_tables[s, j] = block
            n = min(block_size, ctx - j * block_size)
            k_cache[block, :n] = keys[s][j * block_size : j * block_size + n]
            v_cache[block, :n] = values[s][j * block_size : j * block_size + n]
    cu = [0]
    for q_len, _ in seqs:
        cu.append(cu[-1] + q_len)
    return PagedBatch(
        q=q.to(dtype=dtype, device=device),
        k_cache=k_cache.to(dtype=dtype, device=device),
        v_cache=v_cache.to(dtype=dtype, device=device),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor([c for _, c in seqs], dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        max_seqlen_q=max(q for q, _ in seqs),
        max_seqlen_k=max(c for _, c in seqs),
    )


@pytest.fixture(scope="session")
def paged_batch():
    """The :func:`build_paged_batch` builder."""
    return build_paged_batch
