"""How the CPU platform attends a step: an ``AttentionPlan`` groups the step's sequences (decode
rows by similar context length, each prefill chunk alone), gathers each group's cache blocks
into dense K and V and runs torch's ``scaled_dot_product_attention`` in Hugging Face's layout,
so that a sequence alone gets HF's own blocking and rounding in every dtype. A plan is causal
(decoders) or not (bidirectional encoders: every query sees its whole sequence, or the keys
within ``|k - q| < w`` of a sliding window; ``kernels/interface.py``). A causal plan may also
bound each query's keys from below by its chunk's start (``attention_chunk`` C: ``k >= q // C *
C``, Llama 4's chunked layers), in its masks.

The plan is derived from a step's metadata alone (host copies of ``cu_seqlens_q``, ``seq_lens``
and the block tables), so one plan serves every layer of the step
(``engine/platform/cpu/attention.py`` keeps it). The fp32 oracle it is tested against is
``paged_serve.kernels.reference.paged_attention_ref``
(tests/engine/platform/cpu/test_cpu_attention.py)."""

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
    tokens, 203 against 410 at 256; docs/measurements/cpu-kernels.md).
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
    fresh prompt runs causal; equally long decode rows see everything, and so do the queries of
    a non-causal sequence without a window); alone: the step's only sequence of its kind (a
    decode row split into a group of its own by length is not alone); causal: whether a query
    sees only the keys up to its own position (False: its whole sequence, ``_allowed_keys``).

    Layout: q is laid out as Hugging Face's sdpa attention lays it out, ``[S, Hq, Lq, D]`` with
    GQA in the kernel, so a sequence alone gets HF's blocking and rounding in every dtype. Two
    or more decode rows in a step are grouped instead, ``[S, Hkv, G, D]`` (the G query heads of
    one KV head as G query rows): torch's bf16 CPU kernel takes 5x longer on the HF layout at 8
    rows and more (docs/measurements/cpu-kernels.md), and batching changes bf16 rounding anyway.
    ``group_alone`` groups a decode row alone too (3x faster in bf16 at a 128-token context, 4.5x at
    512), for callers whose weights are not HF's anyway (weight-only quantization).
    """

    rows: torch.Tensor | None
    num_seqs: int
    q_len: int
    blocks: torch.Tensor
    max_len: int
    tail: tuple[torch.Tensor, torch.Tensor] | None
    mask: torch.Tensor | None
    alone: bool
    causal: bool = True

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
        causal: bool = True,
        attention_chunk: int | None = None,
    ) -> UniformGroup:
        device = block_tables.device
        num_seqs, max_len = len(seq_lens), max(seq_lens)
        lens = torch.tensor(seq_lens, device=device)
        k_pos = torch.arange(max_len, device=device)
        tail = None
        if min(seq_lens) < max_len:
            tail = (k_pos[None, :] >= lens[:, None]).nonzero(as_tuple=True)
        # The mask is built only where something is cut off: one fresh prompt runs the causal
        # fast path, decode rows of equal length need none, nor do non-causal queries that see
        # every key of their sequence.
        bounds_cut = sliding_window is not None and sliding_window < max_len
        bounds_cut |= attention_chunk is not None and attention_chunk < max_len
        fresh = q_len == max_len and num_seqs == 1
        causal_cuts = causal and q_len > 1 and not fresh
        mask = None
        if causal_cuts or tail is not None or bounds_cut:
            q_pos = (lens - q_len)[:, None] + torch.arange(q_len, device=device)[None, :]
            allowed = _allowed_keys(q_pos, k_pos, lens, sliding_window, causal, attention_chunk)
            mask = allowed[:, None]  # [S, 1, Lq, Lk]
        blocks = context_blocks(block_tables, max_len, block_size)
        alone = num_seqs == 1 if alone is None else alone
        return cls(rows, num_seqs, q_len, blocks, max_len, tail, mask, alone, causal)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        dtype: torch.dtype = torch.float32,
        group_alone: bool = False,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``q [S, Lq, Hq, D]`` over the group's contexts; ``[S, Lq, Hq, D]`` in ``dtype``, the
        precision q, k and v are taken to for the math (``group_alone``: see the class).
        ``softcap`` and ``sinks [Hq]`` (kernels/interface.py) take the explicit path,
        ``_attend_explicit``: torch's SDPA has neither. ``scales``: the K and V scales
        ``[num_blocks, block_size, Hkv]`` of caches holding codes (engine/kv/kv_dtype.py),
        gathered with them and multiplied in after the gather."""
        q_len = q.shape[1]
        k, v = self._gathered(k_cache, v_cache, dtype)
        if scales is not None:
            k_scale, v_scale = self._gathered(scales[0][..., None], scales[1][..., None], dtype)
            k, v = k * k_scale, v * v_scale
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        if self.tail is not None:
            # Slots past a sequence's end may hold NaN, which masking alone does not cancel.
            # (Indexing only the tail beats masked_fill over all of k and v.)
            seq_idx, pos_idx = self.tail
            k[seq_idx, :, pos_idx] = 0.0
            v[seq_idx, :, pos_idx] = 0.0
        if softcap is not None or sinks is not None:
            return self._attend_explicit(q.to(dtype), k, v, scale, softcap, sinks)
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
            is_causal=self.causal and self.mask is None and q_len > 1,
            scale=scale,
            enable_gqa=True,
        )
        return out.transpose(1, 2)

    def _gathered(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's contexts of two caches, dense ``[S, max_len, H, D]`` in ``dtype``."""
        pair = kv_pair(k_cache, v_cache)
        if pair is not None:  # the engine's cache: K and V gathered together
            k, v = gather_blocks(pair, self.blocks, self.max_len).to(dtype)
            return k, v
        k = gather_blocks(k_cache[None], self.blocks, self.max_len)[0].to(dtype)
        v = gather_blocks(v_cache[None], self.blocks, self.max_len)[0].to(dtype)
        return k, v

    def _attend_explicit(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        softcap: float | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """Hugging Face's eager attention, op for op: ``q [S, Lq, Hq, D]``, ``k, v [S, Hkv, L,
        D]``; scores scaled, soft-capped, masked, a sink column per head joined to the softmax
        (in fp32) and dropped after it; ``[S, Lq, Hq, D]``."""
        q = q.transpose(1, 2)  # [S, Hq, Lq, D]
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_len, max_len = q.shape[2], k.shape[2]
        allowed = self.mask
        if allowed is None and q_len > 1 and self.causal:  # one fresh prompt: causal
            allowed = torch.ones(q_len, max_len, dtype=torch.bool, device=q.device)
            allowed = allowed.tril(max_len - q_len)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            column = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
            scores = torch.cat((scores, column), dim=-1)
            scores = scores - scores.amax(dim=-1, keepdim=True)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        return torch.matmul(probs.to(v.dtype), v).transpose(1, 2)


def _allowed_keys(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    lens: torch.Tensor,
    sliding_window: int | None,
    causal: bool,
    attention_chunk: int | None = None,
) -> torch.Tensor:
    """``[S, Lq, Lk]`` bool: which key positions ``k_pos [Lk]`` the queries at ``q_pos [S, Lq]``
    see, of sequences ``lens [S]`` long (``kernels/interface.py``'s rule). Causal: ``k <= q``
    (which keeps them inside their sequence), ``k > q - w`` with a window and ``k >= q // C *
    C`` with a chunk; else every ``k < len``, and ``|k - q| < w`` with a window."""
    k, q = k_pos[None, None, :], q_pos[:, :, None]
    if causal:
        allowed = k <= q
        if sliding_window is not None:
            allowed &= k > q - sliding_window
        if attention_chunk is not None:
            allowed &= k >= q // attention_chunk * attention_chunk
        return allowed
    inside = k < lens[:, None, None]  # [S, 1, Lk]
    if sliding_window is None:
        return inside.expand(-1, q_pos.shape[1], -1)
    return inside & ((k - q).abs() < sliding_window)


# Decode rows are attended in groups padded to each group's longest context. A shorter row
# starts a new group once it is at most half as long as the group's longest and the padding it
# and the rows after it would add is at least this many tokens. The trade, estimated from a
# 24-stream fp32 profile on the 2-core CPU: a padded token costs about 0.3 us a layer (gather
# and attention), a group's extra calls tens of us. Measured: docs/measurements/cpu-kernels.md.
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
    serves every layer of a step. ``pure_decode``: one group holds every row, in order.
    ``causal=False`` builds every group's masks without the causal part (encoders);
    ``attention_chunk`` bounds a causal query's keys by its chunk's start."""

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
        causal: bool = True,
        attention_chunk: int | None = None,
    ) -> AttentionPlan:
        cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
        device = cu_seqlens_q.device
        decode = [i for i in range(len(lens)) if cu[i + 1] - cu[i] == 1]
        common = {
            "sliding_window": sliding_window,
            "block_size": block_size,
            "causal": causal,
            "attention_chunk": attention_chunk,
        }
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
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``q [T, Hq, D]`` -> ``[T, Hq, D]`` in q's dtype, with the math in ``dtype`` (fp32 for
        the reference; the model's own dtype reproduces Hugging Face's attention);
        ``group_alone`` as in ``UniformGroup``; ``softcap``, ``sinks`` as in
        ``kernels/interface.py``; ``scales`` of a quantized cache as ``UniformGroup.attend``."""
        extra = {"group_alone": group_alone, "softcap": softcap, "sinks": sinks, "scales": scales}
        if self.pure_decode:
            out = self.groups[0].attend(q.unsqueeze(1), k_cache, v_cache, scale, dtype, **extra)
            return out.squeeze(1).to(q.dtype)
        out = torch.empty(q.shape, dtype=dtype, device=q.device)
        for g in self.groups:
            rows = g.rows.view(g.num_seqs, g.q_len)
            out[rows] = g.attend(q[rows], k_cache, v_cache, scale, dtype, **extra)
        return out.to(q.dtype)
