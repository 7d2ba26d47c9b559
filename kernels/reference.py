"""Eager PyTorch references for every kernel family (fp32 math).

These are the ground truth the Triton kernels are tested and benchmarked against, and the
engine's `torch` backend (the CPU default) runs them directly, so they are vectorised rather
than written as per-token loops.

Shared conventions (the kernels follow them exactly):

* KV cache: one tensor per layer and side, ``[num_blocks, block_size, num_kv_heads, head_dim]``.
  Token ``t`` of a sequence lives in block ``block_tables[s, t // block_size]`` at offset
  ``t % block_size``; its flat *slot* is ``block * block_size + offset``.
* Ragged queries: the step's query tokens are concatenated, sequence by sequence;
  ``cu_seqlens_q [S + 1]`` gives each sequence's slice. ``seq_lens [S]`` is each sequence's
  context length *including* the new tokens, so the ``i``-th of ``q_len`` new tokens sits at
  position ``seq_len - q_len + i`` and attends to every key at a position ``<=`` its own
  (causal inside the chunk, full over the cached prefix).
* GQA: query head ``h`` reads KV head ``h // (num_q_heads // num_kv_heads)`` (HF's repeat_kv).
* Sampling keeps a token when it passes all of top-k, top-p and min-p, defined on the
  temperature-scaled distribution ``p = softmax(logits / temperature)``:
    - top-k (``k > 0``): ``z_i >= k-th largest z`` (ties at the boundary are kept);
    - top-p (``p < 1``): ``sum(p_j for j in K if p_j > p_i) < top_p * sum(p_j for j in K)``,
      where ``K`` is the top-k set, i.e. nucleus on the top-k-renormalised distribution;
    - min-p (``m > 0``): ``p_i >= m * max(p)``.
  The draw is the exponential race ``argmax_i p_i / E_i`` with ``E_i = -log(u_i)`` over the kept
  tokens, which picks ``i`` with probability ``p_i / sum(kept p)``. Rows with temperature 0 are
  argmax of the raw logits (lowest index on ties). The returned logprob is
  ``log_softmax(logits)`` (unscaled) at the chosen token, as vLLM and OpenAI report it.
* A logits row holding a NaN or +inf, or no finite value at all (every entry -inf), is
  *invalid*: sampling returns token -1 (logprob NaN) for it at any temperature, and the engine
  fails that request instead of emitting a silent token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def context_blocks(block_tables: torch.Tensor, max_len: int, block_size: int) -> torch.Tensor:
    """The blocks holding each sequence's first ``max_len`` tokens, ``[S, ceil(max_len /
    block_size)]`` int64 (the index ``gather_blocks`` takes)."""
    return block_tables[:, : (max_len + block_size - 1) // block_size].long()


SPLIT_GATHER_BYTES = 1 << 19  # 512 KiB a cache: where one gather per cache starts to pay


def gather_blocks(caches: torch.Tensor, blocks: torch.Tensor, max_len: int) -> torch.Tensor:
    """Each sequence's first ``max_len`` cached tokens, dense, from ``C`` caches laid out alike
    (K and V of one layer).

    caches: ``[C, num_blocks, block_size, H, D]`` (any stride between the caches); blocks:
    ``[S, per_seq]`` from ``context_blocks``. Returns ``[C, S, max_len, H, D]`` (positions past a
    sequence's length hold whatever the cache holds there, possibly NaN: callers mask them).
    ``index_select`` over whole blocks is several times faster on a CPU than advanced indexing.
    One call over the caches' second dimension suits small gathers (one call's overhead); from
    ``SPLIT_GATHER_BYTES`` a cache, one call per cache over its first dimension, which torch
    spreads over its threads (2 threads: 81 against 143 us for 24 sequences of 128 fp32
    tokens, 203 against 410 at 256; docs/performance.md).
    """
    count, num_blocks, block_size, num_heads, head_dim = caches.shape
    num_seqs, per_seq = blocks.shape
    flat, index = caches.reshape(count, num_blocks, -1), blocks.reshape(-1)
    if index.numel() * flat.shape[2] * flat.element_size() < SPLIT_GATHER_BYTES:
        dense = flat.index_select(1, index)
    else:
        dense = flat.new_empty(count, index.numel(), flat.shape[2])
        for c in range(count):
            torch.index_select(flat[c], 0, index, out=dense[c])
    dense = dense.view(count, num_seqs, per_seq * block_size, num_heads, head_dim)
    return dense[:, :, :max_len]


def kv_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor | None:
    """``[2, num_blocks, block_size, H, D]``: one view over a layer's K and V caches when they
    are alike views of one storage at a fixed distance (the engine's single KV allocation),
    else None."""
    if (
        k_cache.shape != v_cache.shape
        or k_cache.stride() != v_cache.stride()
        or k_cache.dtype != v_cache.dtype
        or k_cache.untyped_storage().data_ptr() != v_cache.untyped_storage().data_ptr()
    ):
        return None
    distance = v_cache.storage_offset() - k_cache.storage_offset()
    return k_cache.as_strided(
        (2, *k_cache.shape), (distance, *k_cache.stride()), k_cache.storage_offset()
    )


@dataclass(frozen=True, slots=True)
class UniformGroup:
    """Sequences attended together because they bring the same number ``q_len`` of new tokens.

    rows: the flat query rows ``[S * q_len]`` (None: all of q, in order);
    blocks: the blocks holding each context, ``[S, *]`` int64 (``context_blocks``); max_len: the
    longest context;
    tail: the (sequence, position) index pairs past each sequence's end (None when all are
    equally long); mask: ``[S, 1, q_len, max_len]`` bool, or None when nothing is cut off (one
    fresh prompt runs causal; equally long decode rows see everything); alone: the step's only
    sequence of its kind (a decode row split into a group of its own by length is not alone).

    Layout: q is laid out as Hugging Face's sdpa attention lays it out, ``[S, Hq, Lq, D]`` with
    GQA in the kernel, so a sequence alone gets HF's blocking and rounding in every dtype. Two
    or more decode rows in a step are grouped instead, ``[S, Hkv, G, D]`` (the G query heads of
    one KV head as G query rows): torch's bf16 CPU kernel takes 5x longer on the HF layout at 8
    rows and more (docs/performance.md), and batching changes bf16 rounding anyway. ``group_alone``
    groups a decode row alone too (3x faster in bf16 at a 128-token context, 4.5x at 512), for
    callers whose weights are not HF's anyway (weight-only quantization).
    """

    rows: torch.Tensor | None
    num_seqs: int
    q_len: int
    blocks: torch.Tensor
    max_len: int
    tail: tuple[torch.Tensor, torch.Tensor] | None
    mask: torch.Tensor | None
    alone: bool

    @classmethod
    def build(
        cls,
        *,
        rows: torch.Tensor | None,
        block_tables: torch.Tensor,
        block_size: int,
        seq_lens: list[int],
        q_len: int,
        sliding_window: int | None,
        alone: bool | None = None,
    ) -> UniformGroup:
        device = block_tables.device
        num_seqs, max_len = len(seq_lens), max(seq_lens)
        lens = torch.tensor(seq_lens, device=device)
        k_pos = torch.arange(max_len, device=device)
        tail = None
        if min(seq_lens) < max_len:
            tail = (k_pos[None, :] >= lens[:, None]).nonzero(as_tuple=True)
        # The mask is built only where something is cut off: one fresh prompt runs the causal
        # fast path, and decode rows of equal length need none.
        window_cuts = sliding_window is not None and sliding_window < max_len
        fresh = q_len == max_len and num_seqs == 1
        mask = None
        if (q_len > 1 and not fresh) or tail is not None or window_cuts:
            q_pos = (lens - q_len)[:, None] + torch.arange(q_len, device=device)[None, :]
            allowed = k_pos[None, None, :] <= q_pos[:, :, None]  # [S, Lq, Lk]
            if sliding_window is not None:
                allowed &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
            mask = allowed[:, None]  # [S, 1, Lq, Lk]
        blocks = context_blocks(block_tables, max_len, block_size)
        alone = num_seqs == 1 if alone is None else alone
        return cls(rows, num_seqs, q_len, blocks, max_len, tail, mask, alone)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        dtype: torch.dtype = torch.float32,
        group_alone: bool = False,
    ) -> torch.Tensor:
        """``q [S, Lq, Hq, D]`` over the group's contexts; ``[S, Lq, Hq, D]`` in ``dtype``, the
        precision q, k and v are taken to for the math (``group_alone``: see the class)."""
        q_len = q.shape[1]
        pair = kv_pair(k_cache, v_cache)
        if pair is not None:  # the engine's cache: K and V gathered together
            k, v = gather_blocks(pair, self.blocks, self.max_len).to(dtype)
        else:
            k = gather_blocks(k_cache[None], self.blocks, self.max_len)[0].to(dtype)
            v = gather_blocks(v_cache[None], self.blocks, self.max_len)[0].to(dtype)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        if self.tail is not None:
            # Slots past a sequence's end may hold NaN, which masking alone does not cancel.
            # (Indexing only the tail beats masked_fill over all of k and v.)
            seq_idx, pos_idx = self.tail
            k[seq_idx, :, pos_idx] = 0.0
            v[seq_idx, :, pos_idx] = 0.0
        if q_len == 1 and (not self.alone or group_alone):  # grouped decode rows (see above)
            num_seqs, _, num_q_heads, head_dim = q.shape
            qg = q.to(dtype).reshape(num_seqs, k.shape[1], num_q_heads // k.shape[1], head_dim)
            out = F.scaled_dot_product_attention(qg, k, v, attn_mask=self.mask, scale=scale)
            # reshape, not view: CUDA's SDPA returns its output in a transposed layout.
            return out.reshape(num_seqs, 1, num_q_heads, head_dim)
        out = F.scaled_dot_product_attention(
            q.to(dtype).transpose(1, 2),
            k,
            v,
            attn_mask=self.mask,
            is_causal=self.mask is None and q_len > 1,
            scale=scale,
            enable_gqa=True,
        )
        return out.transpose(1, 2)


# Decode rows are attended in groups padded to each group's longest context. A shorter row
# starts a new group once it is at most half as long as the group's longest and the padding it
# and the rows after it would add is at least this many tokens. The trade, estimated from a
# 24-stream fp32 profile on the 2-core CPU: a padded token costs about 0.3 us a layer (gather
# and attention), a group's extra calls tens of us. Measured: docs/performance.md.
MIN_PADDING_SAVED = 256  # tokens


def length_groups(lens: list[int]) -> list[list[int]]:
    """Indices into ``lens`` (context lengths), split into groups of similar length, longest
    first; one group when the lengths are close (see ``MIN_PADDING_SAVED``)."""
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    groups: list[list[int]] = []
    for rank, i in enumerate(order):
        longest = lens[groups[-1][0]] if groups else 0
        remaining = len(order) - rank
        padding = remaining * (longest - lens[i])
        if not groups or (2 * lens[i] <= longest and padding >= MIN_PADDING_SAVED):
            groups.append([i])
        else:
            groups[-1].append(i)
    return groups


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """A step's attention work, derived from its metadata alone: the decode sequences (one query
    token) in groups of similar context length (``length_groups``), each prefill chunk on its
    own, so no sequence is padded far past its own length. It holds no cache data, so one plan
    serves every layer of a step. ``pure_decode``: one group holds every row, in order."""

    groups: tuple[UniformGroup, ...]
    pure_decode: bool

    @classmethod
    def build(
        cls,
        *,
        cu_seqlens_q: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        block_size: int,
        num_tokens: int,
        sliding_window: int | None,
    ) -> AttentionPlan:
        cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
        device = cu_seqlens_q.device
        decode = [i for i in range(len(lens)) if cu[i + 1] - cu[i] == 1]
        common = {"sliding_window": sliding_window, "block_size": block_size}
        split = [[decode[j] for j in g] for g in length_groups([lens[i] for i in decode])]
        pure_decode = len(decode) == len(lens) == num_tokens and len(split) == 1
        groups: list[UniformGroup] = []
        for members in split:
            members.sort()  # in step order, as the rows and block tables are
            if pure_decode:
                rows, tables = None, block_tables
            else:
                rows = torch.tensor([cu[i] for i in members], device=device)
                tables = block_tables[members]
            seqs = [lens[i] for i in members]
            groups.append(
                UniformGroup.build(
                    rows=rows,
                    block_tables=tables,
                    seq_lens=seqs,
                    q_len=1,
                    alone=len(decode) == 1,
                    **common,
                )
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
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        dtype: torch.dtype = torch.float32,
        group_alone: bool = False,
    ) -> torch.Tensor:
        """``q [T, Hq, D]`` -> ``[T, Hq, D]`` in q's dtype, with the math in ``dtype`` (fp32 for
        the reference; the model's own dtype reproduces Hugging Face's ``sdpa`` attention);
        ``group_alone`` as in ``UniformGroup``."""
        if self.pure_decode:
            out = self.groups[0].attend(q.unsqueeze(1), k_cache, v_cache, scale, dtype, group_alone)
            return out.squeeze(1).to(q.dtype)
        out = torch.empty(q.shape, dtype=dtype, device=q.device)
        for g in self.groups:
            rows = g.rows.view(g.num_seqs, g.q_len)
            out[rows] = g.attend(q[rows], k_cache, v_cache, scale, dtype, group_alone)
        return out.to(q.dtype)


def paged_attention_ref(
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
    math_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Attention of ragged query chunks over the paged KV cache, in fp32 (``math_dtype``: the
    engine's CPU backend computes in the model's dtype, as Hugging Face does).

    q: ``[T, Hq, D]``; k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``;
    block_tables: ``[S, max_blocks]`` int32; seq_lens: ``[S]`` int32 (context incl. new tokens);
    cu_seqlens_q: ``[S + 1]`` int32. ``sliding_window`` w (if set) limits each query to the
    ``w`` most recent positions (its own included), as HF's Mistral does.
    ``max_seqlen_q`` / ``max_seqlen_k`` are accepted for interface parity with the kernel.
    Returns ``[T, Hq, D]`` in ``q.dtype``. (The engine's CPU backend keeps the ``AttentionPlan``
    for all layers of a step; here it is derived on every call.)
    """
    plan = AttentionPlan.build(
        cu_seqlens_q=cu_seqlens_q,
        seq_lens=seq_lens,
        block_tables=block_tables,
        block_size=k_cache.shape[1],
        num_tokens=q.shape[0],
        sliding_window=sliding_window,
    )
    return plan.run(q, k_cache, v_cache, scale, math_dtype)


def kept_slots(slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The slots to write and the token rows they come from (None: every row, in order), given
    ``slot_mapping [T]`` where ``-1`` means "do not write"."""
    keep = slot_mapping >= 0
    if bool(keep.all()):
        return slot_mapping, None
    rows = keep.nonzero().squeeze(1)
    return slot_mapping[rows], rows


def scatter_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    rows: torch.Tensor | None,
) -> None:
    """Write rows ``rows`` (None: all) of ``key``/``value`` ``[T, Hkv, D]`` at ``slots``."""
    if rows is not None:
        key, value = key[rows], value[rows]
    num_blocks, block_size = k_cache.shape[:2]
    k_cache.view(num_blocks * block_size, *k_cache.shape[2:])[slots] = key.to(k_cache.dtype)
    v_cache.view(num_blocks * block_size, *v_cache.shape[2:])[slots] = value.to(v_cache.dtype)


def write_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value`` ``[T, Hkv, D]`` into the caches at ``slot_mapping [T]`` (int64).

    Slot ``-1`` means "do not write". In place, exact.
    """
    scatter_kv(key, value, k_cache, v_cache, *kept_slots(slot_mapping))


def copy_blocks_ref(kv_caches: torch.Tensor, *, block_mapping: torch.Tensor) -> None:
    """Copy whole blocks for every layer and side at once.

    kv_caches: ``[num_layers, 2, num_blocks, block_size, Hkv, D]`` (the engine's one allocation);
    block_mapping: ``[N, 2]`` int64 rows of ``(src_block, dst_block)``. In place, exact.
    Destinations must be distinct and never also a source in the same call.
    """
    if block_mapping.numel() == 0:
        return
    src = block_mapping[:, 0].long()
    dst = block_mapping[:, 1].long()
    kv_caches[:, :, dst] = kv_caches[:, :, src]


def sampling_keep_mask(
    logits: torch.Tensor,
    *,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The set of drawable tokens per row, and the temperature-scaled probabilities.

    logits: ``[B, V]`` fp32; temperature, top_p, min_p: ``[B]`` fp32; top_k: ``[B]`` int
    (``<= 0`` or ``>= V`` disables it; ``top_p >= 1`` disables the nucleus, as in the kernel).
    Rows with temperature 0 are treated as temperature 1 here (the caller takes argmax for
    them). Returns ``(keep [B, V] bool, probs [B, V] fp32)``.
    """
    vocab = logits.shape[1]
    z, probs = scaled_logits(logits, temperature)

    k = top_k.long().clamp(min=0)
    k = torch.where((k <= 0) | (k >= vocab), torch.full_like(k, vocab), k)
    sorted_z, _ = torch.sort(z, dim=-1, descending=True)
    kth = sorted_z.gather(1, (k - 1)[:, None])
    keep = z >= kth

    p_k = torch.where(keep, probs, torch.zeros_like(probs))
    total_k = p_k.sum(dim=-1, keepdim=True)
    keep &= nucleus_keep(p_k, total_k, top_p) | (top_p >= 1.0)[:, None]

    keep &= probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return keep, probs


def scaled_logits(
    logits: torch.Tensor, temperature: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(z, probs)``, both ``[B, V]`` fp32: ``z = logits / temperature`` (temperature 0 read
    as 1, for greedy rows' keep sets) and ``probs = softmax(z)``; temperature ``[B]``."""
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    z = logits.float() / temp[:, None]
    return z, torch.softmax(z, dim=-1)


def nucleus_keep(p_k: torch.Tensor, total_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p on the top-k set: ``bool [B, V]``, a token kept when the mass of the tokens with a
    strictly larger probability is below ``top_p * total_k`` (ties kept together).

    p_k: ``[B, V]`` probabilities, 0 outside the top-k set; total_k: ``[B, 1]`` their sum;
    top_p: ``[B]``.
    """
    sorted_p, _ = torch.sort(p_k, dim=-1, descending=True)
    csum = torch.cumsum(sorted_p, dim=-1)
    # For each token: mass of tokens with strictly larger probability.
    first_ge = torch.searchsorted(-sorted_p.contiguous(), -p_k.contiguous(), side="left")
    above = torch.where(
        first_ge > 0,
        csum.gather(1, (first_ge - 1).clamp(min=0)),
        torch.zeros_like(p_k),
    )
    return above < top_p[:, None] * total_k


def sample_ref(
    logits: torch.Tensor,
    *,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row (see the module docstring for the exact rule).

    logits: ``[B, V]`` fp32; uniforms: ``[B, V]`` fp32 in (0, 1), the random numbers of the
    exponential race (the caller decides how they are seeded). Returns
    ``(token_ids [B] int64, logprobs [B] fp32)``; invalid rows (:func:`invalid_rows`) get
    token -1 and logprob NaN.
    """
    logits = logits.float()
    keep, probs = sampling_keep_mask(
        logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p
    )
    return race_draw(logits, keep, probs, temperature=temperature, uniforms=uniforms)


def race_draw(
    logits: torch.Tensor,
    keep: torch.Tensor | None,
    probs: torch.Tensor,
    *,
    temperature: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The draw once the keep set is known: the exponential race ``argmax p / -log(u)`` over
    kept tokens (every token when ``keep`` is None) for rows with temperature > 0, the argmax of
    the raw logits for the others; ``(token_ids [B] int64, logprobs [B] fp32)`` as
    :func:`sample_ref`. (first_argmax is argmax, lowest index on ties; race holds no NaN on a
    valid row.)"""
    race = probs / -torch.log(uniforms.clamp(min=torch.finfo(torch.float32).tiny))
    if keep is not None:
        race = torch.where(keep, race, torch.full_like(race, -1.0))
    drawn = first_argmax(race)
    return with_logprobs(logits, torch.where(temperature > 0, drawn, first_argmax(logits)))


def greedy_ref(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature-0 sampling of every row: argmax (lowest index on ties), invalid rows -1.

    logits: ``[B, V]``. Returns ``(token_ids [B] int64, logprobs [B] fp32)``, the same as
    ``sample_ref`` with every temperature 0.
    """
    logits = logits.float()
    return with_logprobs(logits, first_argmax(logits))


# torch's CPU argmax over a row is not vectorized (about 1 ms for 24 rows of a 49,152-token
# vocabulary on the 2-core CPU) while amax is; chunks of this many logits take an amax each.
ARGMAX_CHUNK = 128


def first_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for ``[B, V]`` rows without NaN (the lowest index holding the
    row's maximum), ``[B]`` int64, found in two levels: the maximum of each chunk of
    ``ARGMAX_CHUNK`` logits, the first chunk holding the row's maximum, the first maximum within
    it (the tail past the last whole chunk compared apart). 145 against 1,021 us for 24 rows of
    49,152 on the 2-core CPU (docs/performance.md). A row holding NaN gets some index: callers
    mark those rows invalid (``invalid_rows``)."""
    rows, vocab = logits.shape
    chunks = vocab // ARGMAX_CHUNK
    if chunks < 2:
        return logits.argmax(dim=-1)
    whole = logits[:, : chunks * ARGMAX_CHUNK].reshape(rows, chunks, ARGMAX_CHUNK)
    chunk_max = whole.amax(dim=-1)  # [B, chunks]
    best_chunk = chunk_max.argmax(dim=-1)  # the first chunk holding the maximum
    inside = whole.gather(1, best_chunk.view(rows, 1, 1).expand(rows, 1, ARGMAX_CHUNK))
    best = best_chunk * ARGMAX_CHUNK + inside[:, 0].argmax(dim=-1)
    if chunks * ARGMAX_CHUNK == vocab:
        return best
    tail_max, tail_arg = logits[:, chunks * ARGMAX_CHUNK :].max(dim=-1)
    # Only a strictly larger tail wins: on a tie the chunks' index is the lower one.
    later = tail_max > chunk_max.gather(1, best_chunk[:, None])[:, 0]
    return torch.where(later, chunks * ARGMAX_CHUNK + tail_arg, best)


def invalid_rows(logits: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: rows holding a NaN or +inf, or no finite value (all -inf).

    One reduction: ``amax`` propagates NaN, so the row maximum is finite exactly for valid rows.
    """
    return ~torch.isfinite(logits.amax(dim=-1))


def with_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Set invalid rows' tokens to -1 and gather the (unscaled) logprob of each token."""
    invalid = invalid_rows(logits)
    tokens = tokens.masked_fill(invalid, -1)
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens.clamp(min=0)[:, None])
    return tokens, logprobs.squeeze(1).masked_fill(invalid, float("nan"))


def unpack_token_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``int32 [B, ceil(V / 32)]`` packed masks -> ``bool [B, V]``: token ``t`` is allowed
    when bit ``t % 32`` of word ``t // 32`` is set."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    unpacked = (bitmask[:, :, None] >> bits) & 1  # [B, W, 32]; >> keeps the sign bit, & 1 drops it
    return unpacked.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """A copy of ``logits [B, V]`` with every token the packed ``bitmask`` disallows at -inf."""
    allowed = unpack_token_bitmask(bitmask, logits.shape[1])
    return logits.masked_fill(~allowed, float("-inf"))
