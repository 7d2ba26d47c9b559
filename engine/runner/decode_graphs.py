"""CUDA graphs for decode steps: one captured forward per batch-size bucket, replayed per step.

A decode step (every scheduled request brings exactly one token) launches a few hundred small
kernels whose CPU launch cost exceeds their GPU time at small batch sizes. At start we capture
the model forward once per bucket size ``1, 2, 4, 8, 16, 24, ...`` over *static* input
buffers; a step of ``B`` requests then copies its metadata into those buffers, replays the
smallest bucket ``>= B`` and reads the first ``B`` rows of that bucket's logits.

Padding rows (``B`` up to the bucket size) are inert: token 0 at position 0, KV slot ``-1``
(the KV write skips it), context length 1 read through whatever block id their table row holds
(always a valid block). Each row of the model's computation is independent, so padding never
changes a real row. Block-table columns past a request's length are stale and never read.
A hybrid model's padding rows use the state cache's scratch slot, from a zero state. With LoRA
adapters every graph reads static per-row adapter slots (``lora_slots``, -1 for padding and
rows without an adapter) and their one-hot mask over all ``--max-loras`` slots, so one capture
serves any mix of adapters.

The kernels fix their launch shapes from host integers, so the captured context declares
``max_seqlen_k`` = the table capacity (``max_blocks_per_seq * block_size``): the split-KV
factor is then fixed per bucket and the kernel cuts each sequence's true length into splits on
the device. Only the triton backend is capturable (the eager reference reads lengths on the host).
Eager steps choose their factor from the true longest context, and a bucket's GEMMs run on more
rows than the batch has, so graph and eager logits agree to fp32 rounding, not bit for bit:
tests compare both with a float64 reference under a stated tolerance
(``tests/greedy_reference.py``), not with each other token for token on trust.

``GraphCapture`` is the seam between this bookkeeping and the capture mechanism:
``CudaGraphCapture`` records ``torch.cuda.CUDAGraph``s; ``EagerReplay`` re-runs the forward
on the same static buffers, so a machine without CUDA tests everything here except the capture.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from paged_serve.engine.kv.attention_context import AttentionContext, attention_context
from paged_serve.engine.kv.kv_cache import KVCache
from paged_serve.engine.kv.lora_step import LoRAStep
from paged_serve.engine.kv.state_cache import StateCache
from paged_serve.engine.model.architecture import decoder_model
from paged_serve.engine.platform.host_tensors import host_tensor
from paged_serve.engine.platform.kernel_backend import KernelBackend
from paged_serve.engine.runner.step_inputs import StepInputs

if TYPE_CHECKING:
    from paged_serve.engine.parallel.group import TensorParallelGroup

logger = logging.getLogger(__name__)

Forward = Callable[[], object]  # a forward that reads and writes only static buffers
Replay = Callable[[], None]
MAX_GRAPH_BATCH_SIZE = 512  # larger decode batches run eagerly: launch cost is amortised there


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """Bucket sizes to capture, ascending: 1, 2, 4, 8, then every multiple of 8, and the max.

    Multiples of 8 bound the padding waste to 7 rows (vLLM's choice too).
    """
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes = [s for s in (1, 2, 4) if s < max_batch_size]
    sizes += range(8, max_batch_size, 8)
    return [*sizes, max_batch_size]


class GraphCapture(Protocol):
    """Turns ``forward`` (static buffers in, static buffers out) into a replay function."""

    def capture(self, forward: Forward) -> Replay: ...


class CudaGraphCapture:
    """Captures each forward in a ``torch.cuda.CUDAGraph``; all graphs share one memory pool.

    Every forward first runs twice on a side stream, so Triton compiles (and cuBLAS picks its
    kernels and workspaces) outside the capture.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, forward: Forward) -> Replay:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                forward()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            forward()
        return graph.replay


class EagerReplay:
    """A stand-in for capture without CUDA: replay re-runs ``forward`` over the same buffers."""

    def capture(self, forward: Forward) -> Replay:
        forward()
        return forward


class DecodeGraphs:
    """Static decode buffers plus one captured forward per bucket size.

    model: the Hugging Face causal LM with paged attention installed; ``max_model_len`` (tokens)
    sets the block-table width. ``with_logits=False`` captures the model body only (a
    tensor-parallel worker, which never samples). ``replays[size]`` counts the steps each
    bucket served and ``padded_rows`` the padding rows they computed in all (the price of
    bucketing). ``state_cache``: a hybrid model's linear-attention state.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        backend: KernelBackend,
        *,
        max_batch_size: int,
        max_model_len: int,
        with_logits: bool = True,
        state_cache: StateCache | None = None,
        max_loras: int = 0,
    ):
        self.model = model
        self.state_cache = state_cache
        self.with_logits = with_logits
        self.kv_cache = kv_cache
        self.backend = backend
        self.sizes = graph_batch_sizes(min(max_batch_size, MAX_GRAPH_BATCH_SIZE))
        self.max_batch_size = self.sizes[-1]
        bs = kv_cache.block_size
        self.table_width = -(-max_model_len // bs)
        self.max_seqlen_k = self.table_width * bs
        device = kv_cache.tensor.device
        n = self.max_batch_size
        self.input_ids = torch.zeros(1, n, dtype=torch.long, device=device)
        self.positions = torch.zeros(1, n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, self.table_width, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        scratch = state_cache.scratch_slot if state_cache is not None else 0
        self.state_slots = torch.full((n,), scratch, dtype=torch.int32, device=device)
        self.has_state = torch.zeros(n, dtype=torch.int32, device=device)
        self.max_loras = max_loras  # adapter slots (0: no LoRA)
        self.lora_slots = torch.full((n,), -1, dtype=torch.int32, device=device)
        self._slot_ids = torch.arange(max_loras, dtype=torch.int32, device=device)
        self._lora_dtype = next(model.parameters()).dtype
        # One fp32 logits buffer for every bucket (each graph's own output would hold sum(sizes)
        # rows); fp32 because the sampler upcasts anyway, so no model's logits lose precision.
        vocab_size = model.get_output_embeddings().weight.shape[0] if with_logits else 0
        self.logits = torch.empty(n, vocab_size, dtype=torch.float32, device=device)
        self._replay: dict[int, Replay] = {}
        self.replays: Counter[int] = Counter()
        self.padded_rows = 0

    @torch.inference_mode()
    def capture(self, capturer: GraphCapture) -> None:
        """Capture every bucket, largest first (smaller graphs then reuse its pool memory)."""
        for size in reversed(self.sizes):
            self._replay[size] = capturer.capture(lambda s=size: self._forward(s))

    def _forward(self, size: int) -> None:
        """The model over the first ``size`` static rows; logits ``[size, V]`` into ``logits``."""
        ctx = AttentionContext(
            cu_seqlens_q=self.cu_seqlens_q[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size],
            max_seqlen_q=1,
            max_seqlen_k=self.max_seqlen_k,
            kv_cache=self.kv_cache,
            backend=self.backend,
            state_cache=self.state_cache,
            state_slots=self.state_slots[:size] if self.state_cache is not None else None,
            has_state=self.has_state[:size] if self.state_cache is not None else None,
            lora=self._lora_step(size),
            positions=self.positions[0, :size],
        )
        with attention_context(ctx):
            if not self.with_logits:
                decoder_model(self.model)(
                    input_ids=self.input_ids[:, :size],
                    position_ids=self.positions[:, :size],
                    use_cache=False,
                )
                return
            out = self.model(
                input_ids=self.input_ids[:, :size],
                position_ids=self.positions[:, :size],
                use_cache=False,
                logits_to_keep=0,
            )
        self.logits[:size].copy_(out.logits[0])

    def _lora_step(self, size: int) -> LoRAStep | None:
        """The static adapter slots of a bucket's rows and their one-hot mask over every slot,
        computed inside the captured forward (None without LoRA)."""
        if not self.max_loras:
            return None
        slots = self.lora_slots[:size]
        mask = (slots[:, None] == self._slot_ids[None, :]).to(self._lora_dtype)[:, :, None]
        return LoRAStep(slots, 0, self.max_loras, mask)

    def holds(self, inputs: StepInputs) -> bool:
        """Whether a captured graph can run this step (decode-shaped, a bucket large enough)."""
        return inputs.is_decode and self.bucket(len(inputs.seq_lens)) is not None

    def bucket(self, batch_size: int) -> int | None:
        """The smallest captured size holding ``batch_size`` rows; None if none does."""
        for size in self.sizes:
            if size >= batch_size:
                return size if size in self._replay else None
        return None

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Replay the bucket for ``inputs``; returns logits ``[B, V]`` (a view of the static
        logits buffer, valid until the next replay).
        """
        if not inputs.is_decode:
            raise ValueError("decode graphs run steps of one token per sequence only")
        count = len(inputs.input_ids)
        size = self.bucket(count)
        if size is None:
            raise ValueError(f"no decode graph holds a batch of {count}")
        pad = size - count
        width = max(len(t) for t in inputs.block_tables)
        if width > self.table_width:
            raise ValueError(
                f"a block table of {width} blocks exceeds the graphs' {self.table_width}"
            )
        tables = [t + [0] * (width - len(t)) for t in inputs.block_tables]
        buffers = [
            (self.input_ids[0, :size], inputs.input_ids + [0] * pad, torch.long),
            (self.positions[0, :size], inputs.positions + [0] * pad, torch.long),
            (self.slot_mapping[:size], inputs.slots + [-1] * pad, torch.int64),
            (self.seq_lens[:size], inputs.seq_lens + [1] * pad, torch.int32),
            (self.block_tables[:count, :width], tables, torch.int32),
        ]
        if self.state_cache is not None:
            scratch = [self.state_cache.scratch_slot] * pad
            buffers.append((self.state_slots[:size], inputs.state_slots + scratch, torch.int32))
            buffers.append((self.has_state[:size], inputs.has_state + [0] * pad, torch.int32))
        if self.max_loras:
            rows = (inputs.lora_slots or [-1] * count) + [-1] * pad
            buffers.append((self.lora_slots[:size], rows, torch.int32))
        for dst, data, dtype in buffers:
            dst.copy_(host_tensor(data, dtype, dst.device), non_blocking=True)
        self._replay[size]()
        self.replays[size] += 1
        self.padded_rows += pad
        return self.logits[:count]


def capture_or_eager(
    graphs: DecodeGraphs, device: torch.device, tp: TensorParallelGroup | None
) -> DecodeGraphs | None:
    """``graphs`` captured on ``device``'s CUDA graphs, or None (run eagerly: slower, never
    wrong) when the capture fails here or, under tensor parallelism, on any rank (ranks
    replay in lockstep, their collectives pairing up: all or none use graphs)."""
    start = time.monotonic()
    try:
        graphs.capture(CudaGraphCapture(device))
        captured = True
    except Exception:
        logger.exception("decode graph capture failed: running eagerly (--enforce-eager)")
        captured = False
    if tp is not None and not tp.all_ranks(captured):
        logger.warning("decode graphs failed on another rank: running eagerly")
        return None
    if not captured:
        return None
    logger.info(
        "captured %d decode graphs (batch sizes up to %d) in %.1f s",
        len(graphs.sizes),
        graphs.max_batch_size,
        time.monotonic() - start,
    )
    return graphs
