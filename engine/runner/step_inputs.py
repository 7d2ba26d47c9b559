"""One scheduled step flattened into host-side lists: the single source of a step's metadata.

The eager forward turns these lists into tensors; the decode graphs copy them into their static
buffers. Building them once keeps the two paths from drifting apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paged_serve.engine.sched.batch import ScheduledBatch
from paged_serve.engine.sched.forks import group_size


@dataclass(frozen=True, slots=True)
class StepInputs:
    """A flat ragged batch of ``S`` sequences and ``T`` tokens, as Python lists.

    input_ids, positions, slots: ``T`` entries (token id, absolute position, cache slot);
    cu_seqlens: ``S + 1`` query offsets; seq_lens: ``S`` context lengths including this step's
    tokens; block_tables: ``S`` ragged lists of block ids; logit_rows: the flat token index each
    sampled row reads its logits from (a request's last token, repeated for its pending forks;
    each of a drafted request's last token and drafts).
    A hybrid model's step also has ``S`` linear-attention ``state_slots`` and ``has_state`` flags
    (0: the sequence's first chunk, which starts from a zero state); empty lists otherwise.
    ``token_type_ids``: ``T`` segment ids when a pooling request of the step has them (a BERT
    cross-encoder's pairs), else empty. ``lora_slots``: ``T`` LoRA adapter slots (-1: the base
    model alone) when a request of the step has an adapter, else empty.
    """

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    cu_seqlens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    logit_rows: list[int]
    state_slots: list[int] = field(default_factory=list)
    has_state: list[int] = field(default_factory=list)
    token_type_ids: list[int] = field(default_factory=list)
    lora_slots: list[int] = field(default_factory=list)

    @property
    def max_seqlen_q(self) -> int:
        return max(b - a for a, b in zip(self.cu_seqlens, self.cu_seqlens[1:]))

    @property
    def is_decode(self) -> bool:
        """Every sequence brings exactly one token (the shape decode graphs capture)."""
        return len(self.input_ids) == len(self.seq_lens)


def flatten_step(
    batch: ScheduledBatch, block_tables: list[list[int]], block_size: int
) -> StepInputs:
    """The step's tokens in scheduled order, with their slots in each request's blocks.

    A drafted request (``engine/sample/sampling_rows.py``) enters as ``k + 1`` one-token
    sequences over its one block table, the ``j``-th attending to the context up to its own
    position: causal attention over the draft, as a prefill chunk would compute it, in the
    shape of decode rows (the CPU's decode kernel, the decode graphs)."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    cu = [0]
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    logit_rows: list[int] = []
    for sched, table in zip(batch.requests, block_tables):
        request = sched.request
        input_ids += request.tokens_between(sched.start, sched.end - len(sched.draft))
        input_ids += sched.draft
        pos = range(sched.start, sched.end)
        positions += pos
        slots += [table[p // block_size] * block_size + p % block_size for p in pos]
        if sched.draft:  # every position scored, each a decode row of its own
            for p in pos:
                cu.append(cu[-1] + 1)
                seq_lens.append(p + 1)
                tables.append(table)
                logit_rows.append(cu[-1] - 1)
            continue
        cu.append(cu[-1] + sched.num_new_tokens)
        seq_lens.append(sched.end)
        tables.append(table)
        if sched.samples:
            # Pending forks (n > 1) sample their first token from the same logits row.
            logit_rows += [cu[-1] - 1] * group_size(request)
    has_state = [int(s.start > 0) for s in batch.requests] if batch.state_slots else []
    token_types: list[int] = []
    if any(s.request.pooling and s.request.pooling.token_type_ids for s in batch.requests):
        for s in batch.requests:
            types = s.request.pooling.token_type_ids if s.request.pooling else None
            token_types += list(types[s.start : s.end]) if types else [0] * s.num_new_tokens
    lora_slots: list[int] = []
    if any(s.request.lora is not None for s in batch.requests):
        for s in batch.requests:
            lora_slots += [s.request.lora_slot] * s.num_new_tokens
    return StepInputs(
        input_ids,
        positions,
        slots,
        cu,
        seq_lens,
        tables,
        logit_rows,
        list(batch.state_slots),
        has_state,
        token_types,
        lora_slots,
    )
