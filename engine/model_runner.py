"""Run one scheduled step through the Hugging Face model as a single flat ragged batch.

Each scheduled request contributes ``num_new_tokens`` consecutive tokens; they are concatenated
into ``input_ids [1, T]`` with their true positions in ``position_ids [1, T]`` (no padding, no HF
cache object). The attention metadata goes in an ``AttentionContext``; the LM head runs only at
the last scheduled token of each request that samples this step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention_backend import AttentionBackend
from engine.attention_context import AttentionContext, attention_context
from engine.kv_cache import KVCache
from engine.request import Request
from engine.sampler import Sampler, SamplingBatch
from engine.scheduler import ScheduledBatch


@dataclass(frozen=True, slots=True)
class StepResult:
    """Sampled tokens for the requests that sample this step, in scheduled order.

    top_logprobs: per sampled row, the ``k`` best (token id, logprob) pairs, where ``k`` is the
    largest ``logprobs`` any request asked for (empty lists when none asked).
    """

    request_ids: list[str]
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]


class ModelRunner:
    """Owns the model, the KV cache and the sampler; executes ``ScheduledBatch``es."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        backend: AttentionBackend,
        sampler: Sampler,
        device: torch.device,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.sampler = sampler
        self.device = device
        self.block_size = kv_cache.block_size
        self.vocab_size = int(model.config.vocab_size)

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype)
        return (
            t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else t
        )

    def build_context(self, batch: ScheduledBatch, block_tables: list[list[int]]) -> tuple:
        """Flatten the batch: (input_ids, position_ids, AttentionContext, logits indices)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        seq_lens: list[int] = []
        last_indices: list[int] = []
        for sched, table in zip(batch.requests, block_tables):
            request = sched.request
            input_ids += request.tokens_between(sched.start, sched.end)
            pos = range(sched.start, sched.end)
            positions += pos
            slots += [table[p // bs] * bs + p % bs for p in pos]
            cu.append(cu[-1] + sched.num_new_tokens)
            seq_lens.append(sched.end)
            if sched.samples:
                # Pending forks (n > 1) sample their first token from the same logits row.
                last_indices += [cu[-1] - 1] * (1 + len(request.pending_forks))
        width = max(len(t) for t in block_tables)
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        ctx = AttentionContext(
            cu_seqlens_q=self._tensor(cu, torch.int32),
            seq_lens=self._tensor(seq_lens, torch.int32),
            block_tables=self._tensor(padded, torch.int32),
            slot_mapping=self._tensor(slots, torch.int64),
            max_seqlen_q=max(r.num_new_tokens for r in batch.requests),
            max_seqlen_k=max(seq_lens),
            kv_cache=self.kv_cache,
            backend=self.backend,
        )
        return (
            self._tensor(input_ids, torch.long)[None],
            self._tensor(positions, torch.long)[None],
            ctx,
            last_indices,
        )

    @staticmethod
    def sampling_rows(batch: ScheduledBatch) -> list[Request]:
        """The requests that sample this step, each followed by its pending forks."""
        rows: list[Request] = []
        for s in batch.requests:
            if s.samples:
                rows += [s.request, *s.request.pending_forks]
        return rows

    def sampling_batch(self, rows: list[Request]) -> SamplingBatch:
        params = [r.params for r in rows]
        return SamplingBatch(
            temperature=self._tensor([p.temperature for p in params], torch.float32),
            # top-k of 0 or at least the vocabulary is no top-k: never overflow the int32 row.
            top_k=self._tensor(
                [min(max(p.top_k, 0), self.vocab_size) for p in params], torch.int32
            ),
            top_p=self._tensor([p.top_p for p in params], torch.float32),
            min_p=self._tensor([p.min_p for p in params], torch.float32),
            seeds=self._tensor([r.seed for r in rows], torch.int64),
            steps=self._tensor([len(r.output_token_ids) for r in rows], torch.int64),
            all_greedy=all(p.greedy for p in params),
        )

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, block_tables: list[list[int]]) -> StepResult:
        """Copy-on-write blocks, run the forward, sample at each sampling request's last token."""
        if batch.block_copies:
            mapping = self._tensor([list(p) for p in batch.block_copies], torch.int64)
            self.backend.copy_blocks(self.kv_cache.tensor, block_mapping=mapping)
        input_ids, position_ids, ctx, last_indices = self.build_context(batch, block_tables)
        sampled = self.sampling_rows(batch)
        if not sampled:
            with attention_context(ctx):
                self.model.model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
            return StepResult([], [], [], [])
        keep = self._tensor(last_indices, torch.long)
        with attention_context(ctx):
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                use_cache=False,
                logits_to_keep=keep,
            )
        logits = out.logits[0].float()  # [num_sampled, V]
        tokens, logprobs = self.sampler(logits, self.sampling_batch(sampled))
        k = max((r.params.logprobs or 0) for r in sampled)
        top: list[list[tuple[int, float]]] = [[] for _ in sampled]
        if k > 0:
            values, indices = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
            top = [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
        return StepResult(
            request_ids=[r.request_id for r in sampled],
            token_ids=tokens.tolist(),
            logprobs=logprobs.tolist(),
            top_logprobs=top,
        )
