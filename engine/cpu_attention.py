"""The ``torch`` attention backend: the references' arithmetic, each step's metadata derived once.

``kernels/reference.py`` is the ground truth and stays simple, so it derives everything on every
call: the host copies of ``cu_seqlens_q`` and ``seq_lens``, which rows decode, the blocks to
gather, the positions past each sequence's end, the masks and the slots to write. A step calls
attention once per layer with the *same* metadata tensors (one ``AttentionContext``), so this
backend derives them at the first layer into a ``StepPlan`` and reuses it for the others::

    layer 0:  plan = StepPlan.build(cu_seqlens_q, seq_lens, block_tables, ...)   # host work
    layer i:  gather K/V by plan.blocks -> zero plan.tail -> SDPA(plan.mask)      # tensor work

A plan is keyed on the identity of those tensors (held, so an id is never reused while it is
the key). Per layer the operations are the reference's, op for op, so the outputs equal
``paged_attention_ref`` and ``write_kv_ref`` bit for bit (tests/test_cpu_attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.reference import gather_context


@dataclass(frozen=True, slots=True)
class UniformGroup:
    """Sequences attended together because they bring the same number ``q_len`` of new tokens.

    rows: the flat query rows ``[S * q_len]`` (None: all of q, in order);
    block_tables: ``[S, *]``; max_len: the longest context;
    tail: the (sequence, position) index pairs past each sequence's end (None when all are
    equally long); mask: ``[S, 1, G * q_len, max_len]`` bool, or None for the causal fast path
    of one fresh prompt.
    """

    rows: torch.Tensor | None
    num_seqs: int
    q_len: int
    block_tables: torch.Tensor
    max_len: int
    tail: tuple[torch.Tensor, torch.Tensor] | None
    mask: torch.Tensor | None

    @classmethod
    def build(
        cls,
        *,
        rows: torch.Tensor | None,
        block_tables: torch.Tensor,
        seq_lens: list[int],
        q_len: int,
        group: int,
        sliding_window: int | None,
    ) -> UniformGroup:
        device = block_tables.device
        num_seqs, max_len = len(seq_lens), max(seq_lens)
        lens = torch.tensor(seq_lens, device=device)
        k_pos = torch.arange(max_len, device=device)
        tail = None
        if min(seq_lens) < max_len:
            tail = (k_pos[None, :] >= lens[:, None]).nonzero(as_tuple=True)
        mask = None
        fresh = q_len == max_len and num_seqs == 1
        if not (fresh and (sliding_window is None or sliding_window >= q_len)):
            q_pos = (lens - q_len)[:, None] + torch.arange(q_len, device=device)[None, :]
            allowed = k_pos[None, None, :] <= q_pos[:, :, None]  # [S, Lq, Lk]
            if sliding_window is not None:
                allowed &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
            mask = allowed[:, None].expand(num_seqs, group, q_len, max_len)
            mask = mask.reshape(num_seqs, 1, group * q_len, max_len)
        return cls(rows, num_seqs, q_len, block_tables, max_len, tail, mask)

    def attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """``q [S, Lq, Hq, D]`` over the group's contexts; ``[S, Lq, Hq, D]`` in fp32."""
        num_seqs, q_len, num_q_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        group = num_q_heads // num_kv_heads
        k = gather_context(k_cache, self.block_tables, self.max_len).float().transpose(1, 2)
        v = gather_context(v_cache, self.block_tables, self.max_len).float().transpose(1, 2)
        if self.tail is not None:
            # Slots past a sequence's end may hold NaN, which masking alone does not cancel.
            # (Indexing only the tail beats masked_fill over all of k and v.)
            seq_idx, pos_idx = self.tail
            k[seq_idx, :, pos_idx] = 0.0
            v[seq_idx, :, pos_idx] = 0.0
        if self.mask is None:
            qt = q.float().transpose(1, 2)
            out = F.scaled_dot_product_attention(
                qt, k, v, is_causal=True, scale=scale, enable_gqa=True
            )
            return out.transpose(1, 2)
        qg = q.float().view(num_seqs, q_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
        qg = qg.reshape(num_seqs, num_kv_heads, group * q_len, head_dim)
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=self.mask, scale=scale)
        out = out.view(num_seqs, num_kv_heads, group, q_len, head_dim).permute(0, 3, 1, 2, 4)
        return out.reshape(num_seqs, q_len, num_q_heads, head_dim)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step's attention work: the decode rows as one group, each prefill chunk on its own
    (as the reference splits them, so no sequence is padded to another's query length)."""

    groups: tuple[UniformGroup, ...]
    pure_decode: bool

    @classmethod
    def build(
        cls,
        *,
        cu_seqlens_q: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        num_tokens: int,
        group: int,
        sliding_window: int | None,
    ) -> StepPlan:
        cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
        device = cu_seqlens_q.device
        decode = [i for i in range(len(lens)) if cu[i + 1] - cu[i] == 1]
        common = {"group": group, "sliding_window": sliding_window}
        pure_decode = len(decode) == len(lens) == num_tokens
        groups: list[UniformGroup] = []
        if decode:
            rows = None if pure_decode else torch.tensor([cu[i] for i in decode], device=device)
            tables = block_tables if pure_decode else block_tables[decode]
            seqs = [lens[i] for i in decode]
            groups.append(
                UniformGroup.build(rows=rows, block_tables=tables, seq_lens=seqs, q_len=1, **common)
            )
        for i in range(len(lens)):
            q_len = cu[i + 1] - cu[i]
            if q_len > 1:
                rows = torch.arange(cu[i], cu[i + 1], device=device)
                groups.append(
                    UniformGroup.build(
                        rows=rows,
                        block_tables=block_tables[i : i + 1],
                        seq_lens=[lens[i]],
                        q_len=q_len,
                        **common,
                    )
                )
        return cls(tuple(groups), pure_decode)

    def run(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """``q [T, Hq, D]`` -> ``[T, Hq, D]`` in q's dtype."""
        if self.pure_decode:
            out = self.groups[0].attend(q.unsqueeze(1), k_cache, v_cache, scale)
            return out.squeeze(1).to(q.dtype)
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        for g in self.groups:
            rows = g.rows.view(g.num_seqs, g.q_len)
            out[rows] = g.attend(q[rows], k_cache, v_cache, scale)
        return out.to(q.dtype)


class PlannedTorchAttention:
    """``write_kv`` and ``paged_attention`` with the reference's signatures, planned per step."""

    def __init__(self) -> None:
        self._plan_key: tuple[object, ...] = ()
        self._plan: StepPlan | None = None
        self._slots_key: torch.Tensor | None = None
        self._slots: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        *,
        slot_mapping: torch.Tensor,
    ) -> None:
        """As ``write_kv_ref``: scatter ``[T, Hkv, D]`` at ``slot_mapping [T]`` (-1: skip)."""
        if self._slots_key is not slot_mapping:
            keep = slot_mapping >= 0
            rows = None if bool(keep.all()) else keep.nonzero().squeeze(1)
            slots = slot_mapping if rows is None else slot_mapping[rows]
            self._slots_key, self._slots = slot_mapping, (slots, rows)
        slots, rows = self._slots
        if rows is not None:
            key, value = key[rows], value[rows]
        num_blocks, block_size = k_cache.shape[:2]
        k_cache.view(num_blocks * block_size, *k_cache.shape[2:])[slots] = key.to(k_cache.dtype)
        v_cache.view(num_blocks * block_size, *v_cache.shape[2:])[slots] = value.to(v_cache.dtype)

    def paged_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        *,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_k: int | None = None,
    ) -> torch.Tensor:
        """As ``paged_attention_ref``: ``q [T, Hq, D]`` over the paged cache, fp32 math."""
        group = q.shape[1] // k_cache.shape[2]
        key = (cu_seqlens_q, seq_lens, block_tables, q.shape[0], group, sliding_window)
        if self._plan is None or not _same_key(key, self._plan_key):
            self._plan = StepPlan.build(
                cu_seqlens_q=cu_seqlens_q,
                seq_lens=seq_lens,
                block_tables=block_tables,
                num_tokens=q.shape[0],
                group=group,
                sliding_window=sliding_window,
            )
            self._plan_key = key
        return self._plan.run(q, k_cache, v_cache, scale)


def _same_key(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    """Tensors compare by identity, the rest by value."""
    return len(a) == len(b) and all(
        x is y if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b)
    )
