"""Paged attention: ragged prefill chunks and decode tokens over a block-table KV cache.

Semantics are exactly those of :func:`paged_serve.kernels.reference.paged_attention_ref` (read its
module docstring for the KV layout, ragged-query and GQA conventions).

Algorithm
---------
FlashAttention-2 style: each program owns a tile of query rows and streams the sequence's keys
in tiles of ``TILE_N`` positions, keeping an online softmax (running max ``m``, running sum
``l``, unnormalised accumulator ``acc``, all fp32; scores in log2 units so ``exp2`` is used).

* **GQA packing.** A tile's ``BLOCK_M`` rows are (query token, query head) pairs of ONE KV head:
  row ``r`` is token ``r // GROUP`` of the tile and head ``kv_head * GROUP + r % GROUP``. Every
  K/V tile is therefore loaded once for the whole head group, and a decode step with a small
  group still gives ``tl.dot`` an M dimension >= 16 (unused rows are masked).
* **Paging.** Key position ``n`` lives in block ``block_tables[seq, n // BLOCK_SIZE]`` at offset
  ``n % BLOCK_SIZE``; the tile gathers the block id per key, so ``TILE_N`` is independent of the
  cache block size and blocks may be anywhere (shuffled, non-monotonic tables).
* **Masking.** Keys at positions ``>= seq_len`` are never loaded (masked loads, ``other=0``), so
  free or poisoned (NaN) cache slots and stale block-table entries cannot reach the result.
  Loaded keys are masked to ``-inf`` where causal (``key_pos > query_pos``) or outside the
  sliding window; rows that have seen no key yet keep ``m = -inf`` without producing NaN.
* **Causality** is a compile-time switch (``CAUSAL``). Causal, a query tile reads keys up to
  its last query's position (``[q_lo - w + 1, q_hi]`` with a window ``w``); not causal
  (bidirectional encoders), up to ``seq_len`` (``[q_lo - w + 1, q_hi + w)`` with a window,
  where a key is seen when ``|key_pos - query_pos| < w``), clipped to ``[0, seq_len)``.
* **Chunked local attention** (``attention_chunk`` C, compile-time ``USE_CHUNK``; causal
  only): a query at ``q`` also sees no key before ``q // C * C``. The tile's key range starts
  at ``max(window bound, q_lo // C * C)`` (its first query's chunk), so key tiles wholly before
  it are never loaded -- prefill chunks, decode rows and every split-KV run alike -- and the
  per-key mask drops the earlier keys of rows in later chunks.
* **Head dims** that are not powers of two (80, 96) are padded to the next power of two with
  masked loads; the padded lanes are zero so they add nothing to ``q . k``.

Split-KV (flash-decoding)
-------------------------
With ``num_kv_splits > 1`` the key range of each tile is cut into ``num_kv_splits`` contiguous
runs of key tiles, one program each. Each writes its normalised partial output and its
log-sum-exp (log2 units) to an fp32 workspace, and the partials are merged (``_merge_partials``):
``out = sum_j 2^(lse_j - max lse) * out_j / sum_j 2^(lse_j - max lse)``. Empty runs write
``lse = -inf`` and drop out of the merge. With ``fuse_merge`` (the default) a decode-only
launch folds the merge into itself: each split program counts itself on its (sequence, KV
head)'s int32 ticket (``acq_rel`` atomic after a barrier), and the last one merges in split
order -- bit for bit ``_paged_attention_reduce_kernel``'s result, whichever program is last --
and zeroes the ticket again, so CUDA graphs replay with the same counters.

``num_kv_splits=None`` picks a value with :func:`choose_num_kv_splits`, a fixed function of
the shapes and the multiprocessor count (no autotuning): only decode-only batches
(``max_seqlen_q == 1``) with too few (sequence, KV head) programs to fill the GPU split, as
many times as FlashAttention's wave-efficiency rule says.

Grids
-----
* main: ``(num_q_tiles, num_kv_heads, num_kv_splits)``. Decode-only batches use one tile per
  sequence (``num_q_tiles = num_seqs``). Otherwise sequence ``s`` owns the tiles starting at
  ``cu_seqlens_q[s] // TOKENS_PER_TILE + s`` (enough for ``ceil(q_len / TOKENS_PER_TILE)``
  tiles), ``num_q_tiles = num_tokens // TOKENS_PER_TILE + num_seqs``, and a program finds its
  sequence by binary search over ``cu_seqlens_q`` -- no host sync, surplus programs exit.
* reduce (split-KV with prefill chunks or ``fuse_merge=False``): ``(num_tokens, cdiv(num_q_heads,
  BLOCK_H))``, ``BLOCK_H`` <= 16 heads.

Tiles: ``BLOCK_M`` = 16 rows for decode-only batches, else 64 (32 for head dims > 128), raised
to the group size if larger; ``TILE_N`` = 64 keys (32 for head dims > 128).

Quantized KV cache
------------------
With ``k_scale``, ``v_scale`` (``kernels/interface.py``'s layout: int8 / float8_e4m3fn /
float8_e5m2 codes ``[num_blocks, block_size, Hkv, D]``, fp32 scales ``[num_blocks, block_size,
Hkv]``) the compile-time ``QUANT`` switch makes ``_load_kv_tile`` read, beside each gathered
``[TILE_N, D]`` tile of codes, the ``[TILE_N]`` scales of the same slots and KV head, and hand
on ``code.to(fp32) * scale`` (in q's dtype for fp16/bf16 dots): every path that reads the cache
-- decode, prefill chunks, split-KV runs, with windows, soft-cap, sinks, causal or not -- goes
through that one load, and nothing after it changes. Positions past ``kv_hi`` read neither codes
nor scales. ``QUANT=False`` builds the same instructions as before the switch existed (sm_90
PTX of 16 fp32/bf16 builds compared, parameter list and debug info aside); a quantized launch
pipelines one stage less where the full depth spilled (:func:`attention_tiles`).

Interpreter caveats: Triton 3.9's interpreter computes ``tl.dot`` on raw bf16 operands wrongly,
so under ``TRITON_INTERPRET=1`` bf16 operands are cast to fp32 before the dots. On CUDA, fp32
operands use ``input_precision="ieee"`` (not TF32) so fp32 results match the reference.

Layout
------
The kernel is built from ``@triton.jit`` helpers, which Triton inlines (the same PTX as one
long body): ``_locate_q_tile`` (the binary search), ``_key_tiles`` (the split's run of key
tiles), ``_load_kv_tile`` (one gathered K/V tile), ``_attend_key_tile`` (the scores of a tile,
masked by ``_allowed_keys``, then ``_online_softmax_step``) and ``_store_rows`` (the normalised
rows, or a split's partials and, with the fused merge, the last split's ``_merge_partials``);
``merge_splits`` launches the reduce. The launcher checks its inputs with
``kernels/triton/attention_checks.py``, which returns the sizes as an ``AttentionShapes``
record, and takes every launch setting -- grids, compile-time arguments, warps -- from the
frozen ``AttentionLaunch`` that :func:`attention_launch` builds (``ci/aot_compile.py`` compiles
from the same record).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import triton
import triton.language as tl
from paged_serve.kernels.reference import check_attention_chunk
from paged_serve.kernels.triton.attention_checks import (
    AttentionShapes,
    check_attention_inputs,
    check_out,
    check_sinks,
    check_tickets,
    check_workspace,
)
from paged_serve.kernels.triton.runtime import REFERENCE_SMS, interpreting, multiprocessor_count

# Split-KV heuristic (choose_num_kv_splits): no split once the unsplit launch fills this share of
# the SMs, at least this many keys per split, at most this many splits, and the fewest splits
# whose wave efficiency is within this share of the best.
_FULL_ENOUGH = 0.8
_MIN_KEYS_PER_SPLIT = 512
_MAX_KV_SPLITS = 32
_EFFICIENCY_SHARE = 0.85
_LOG2_E = 1.4426950408889634


@triton.jit
def _locate_q_tile(
    cu_seqlens_q_ptr, pid_q, num_seqs, TOKENS_PER_TILE: tl.constexpr, DECODE_ONLY: tl.constexpr
):
    """``(seq, tile)``: the sequence and which of its query tiles program ``pid_q`` owns.

    Decode-only batches have one tile per sequence. Otherwise sequence ``s``'s tiles start at
    ``cu_seqlens_q[s] // TOKENS_PER_TILE + s``, non-decreasing in ``s``: a binary search finds
    the largest ``s`` whose first tile is ``<= pid_q`` (on the device, no host sync).
    """
    if DECODE_ONLY:
        seq = pid_q
        tile = 0
    else:
        lo = tl.zeros([], dtype=tl.int32)
        hi = tl.zeros([], dtype=tl.int32) + num_seqs - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            mid_start = tl.load(cu_seqlens_q_ptr + mid) // TOKENS_PER_TILE + mid
            if mid_start <= pid_q:
                lo = mid
            else:
                hi = mid - 1
        seq = lo
        tile = pid_q - (tl.load(cu_seqlens_q_ptr + seq) // TOKENS_PER_TILE + seq)
    return seq, tile


@triton.jit
def _key_tiles(
    seq_len,
    q_len,
    tile_tok0,
    split,
    num_kv_splits,
    sliding_window,
    TOKENS_PER_TILE: tl.constexpr,
    TILE_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """``_bounded_key_tiles`` without a chunk bound (the latent-attention kernel's)."""
    return _bounded_key_tiles(
        seq_len, q_len, tile_tok0, split, num_kv_splits, sliding_window, 1,
        TOKENS_PER_TILE, TILE_N, USE_WINDOW, False, CAUSAL,
    )  # fmt: skip


@triton.jit
def _bounded_key_tiles(
    seq_len,
    q_len,
    tile_tok0,
    split,
    num_kv_splits,
    sliding_window,
    attention_chunk,
    TOKENS_PER_TILE: tl.constexpr,
    TILE_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_CHUNK: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """``(kv_lo, kv_hi, first, end)``: the query tile needs keys ``[kv_lo, kv_hi)`` (up to its
    last query's position when ``CAUSAL``, else to ``seq_len``; from the window's start and,
    with ``USE_CHUNK``, no earlier than its first query's chunk start; ``kv_lo`` a multiple of
    ``TILE_N``), and this split walks key tiles ``[first, end)`` of them, one contiguous run of
    ``cdiv(tiles, num_kv_splits)`` tiles."""
    last_tok = tl.minimum(q_len, tile_tok0 + TOKENS_PER_TILE) - 1
    kv_hi = seq_len - q_len + last_tok + 1
    if not CAUSAL:  # keys after the queries too: |k - q| < w reaches q_hi + w - 1
        if USE_WINDOW:
            kv_hi = tl.minimum(kv_hi - 1 + sliding_window, seq_len)
        else:
            kv_hi = seq_len
    first_q = seq_len - q_len + tile_tok0  # the tile's first query position
    kv_lo = first_q * 0
    if USE_WINDOW:
        kv_lo = tl.maximum(first_q - sliding_window + 1, 0)
    if USE_CHUNK:  # the tile's other queries sit in this chunk or later ones
        kv_lo = tl.maximum(kv_lo, (first_q // attention_chunk) * attention_chunk)
    kv_lo = (kv_lo // TILE_N) * TILE_N
    num_tiles = tl.cdiv(kv_hi - kv_lo, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, num_kv_splits)
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)
    return kv_lo, kv_hi, tile_begin, tile_end


@triton.jit
def _load_kv_tile(
    k_cache_ptr,
    v_cache_ptr,
    table_row,
    kv_head,
    offs_n,
    n_valid,
    offs_d,
    d_mask,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    k_scale_ptr,
    v_scale_ptr,
    stride_scale_block,
    stride_scale_slot,
    q_ptr,
    BLOCK_SIZE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    QUANT: tl.constexpr,
):
    """``(k, v)`` ``[TILE_N, HEAD_DIM_PAD]`` at key positions ``offs_n``, each gathered through
    its own block-table entry; invalid positions and padded head lanes read 0. ``QUANT``: the
    caches hold codes, dequantized here (``code * scale``, fp32, one scale per key) and given
    to the dots in q's dtype (fp32 with ``DOT_FP32``)."""
    # Only positions < kv_hi <= seq_len are read: free slots (possibly NaN) never are.
    block = tl.load(table_row + offs_n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
    offset = (offs_n % BLOCK_SIZE).to(tl.int64)
    slot = block * stride_cache_block + offset * stride_cache_slot + kv_head * stride_cache_head
    kv_mask = n_valid[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + slot[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + slot[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    if QUANT:
        # scales [num_blocks, block_size, Hkv]: the tile's keys' scales of this KV head
        scale_slot = block * stride_scale_block + offset * stride_scale_slot + kv_head
        k_scale = tl.load(k_scale_ptr + scale_slot, mask=n_valid, other=0.0)
        v_scale = tl.load(v_scale_ptr + scale_slot, mask=n_valid, other=0.0)
        k = k.to(tl.float32) * k_scale[:, None]
        v = v.to(tl.float32) * v_scale[:, None]
        if not DOT_FP32:
            k = k.to(q_ptr.dtype.element_ty)
            v = v.to(q_ptr.dtype.element_ty)
    elif DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _attend_key_tile(
    q,
    k,
    v,
    offs_n,
    n_valid,
    q_pos,
    sliding_window,
    attention_chunk,
    scale_log2,
    softcap_in,
    softcap_out,
    m_i,
    l_i,
    acc,
    USE_WINDOW: tl.constexpr,
    USE_CHUNK: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over a key tile: ``(m_i, l_i, acc)`` updated with the scores
    ``q . k`` (log2 units) of the keys each row may see (``_allowed_keys``). With
    ``USE_SOFTCAP`` a score is ``c * tanh(scale * q.k / c)``: ``softcap_in = scale / c``,
    ``softcap_out = c * log2(e)``."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if USE_SOFTCAP:
        # tanh(x) = 1 - 2 / (e^2x + 1): exact at both ends (e^2x -> inf gives 1, -> 0 gives -1)
        e2x = tl.exp2(s * (softcap_in * 2.0 * 1.4426950408889634))
        s = (1.0 - 2.0 / (e2x + 1.0)) * softcap_out
    else:
        s = s * scale_log2
    allowed = _allowed_keys(
        offs_n, n_valid, q_pos, sliding_window, attention_chunk, USE_WINDOW, USE_CHUNK, CAUSAL
    )
    s = tl.where(allowed, s, float("-inf"))
    return _online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION)


@triton.jit
def _allowed_keys(
    offs_n,
    n_valid,
    q_pos,
    sliding_window,
    attention_chunk,
    USE_WINDOW: tl.constexpr,
    USE_CHUNK: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """``[rows, TILE_N]`` (``[1, TILE_N]`` when no row differs): which loaded keys
    (positions ``offs_n``) each row's query (position ``q_pos``) sees. ``CAUSAL``: ``k <= q``,
    ``k > q - w`` with a window and ``k >= q // C * C`` with a chunk; else every key, and
    ``|k - q| < w`` with a window."""
    allowed = n_valid[None, :]
    if CAUSAL:
        allowed = allowed & (offs_n[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            allowed = allowed & (offs_n[None, :] > q_pos[:, None] - sliding_window)
        if USE_CHUNK:
            chunk_start = (q_pos // attention_chunk) * attention_chunk
            allowed = allowed & (offs_n[None, :] >= chunk_start[:, None])
    elif USE_WINDOW:
        distance = offs_n[None, :] - q_pos[:, None]
        allowed = allowed & (distance < sliding_window) & (distance > -sliding_window)
    return allowed


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """``(m_i, l_i, acc)`` after one tile of masked scores ``s`` (log2 units, ``-inf`` where a
    row may not see the key) and its values ``v``."""
    # A row with no allowed key so far keeps m = -inf and uses 0 as its reference so
    # exp2(-inf - m) is 0 rather than NaN.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _store_rows(
    acc,
    m_i,
    l_i,
    row_valid,
    d_mask,
    offs_d,
    token,
    head,
    split,
    num_heads,
    num_kv_splits,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    tickets_ptr,
    sinks_ptr,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    SPLIT: tl.constexpr,
    MERGE: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    """Normalise the rows and store them: to ``out`` ``[T, H, HEAD_DIM]``, or with split-KV the
    partial output and its log-sum-exp to the workspace. With ``MERGE`` the split programs of
    one (query tile, head block) count themselves on its ticket, and the last to finish merges
    every partial into ``out`` (``_merge_partials``, splits in index order whichever program it
    is) and sets the ticket back to 0: no reduce launch."""
    has_keys = l_i > 0.0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    out_mask = row_valid[:, None] & d_mask[None, :]
    out_rows = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    if SPLIT:
        part_base = (token * num_heads + head) * num_kv_splits
        part_row = part_base + split
        tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=out_mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part_row, lse, mask=row_valid)
        if MERGE:
            ticket = tickets_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
            tl.debug_barrier()  # every thread's partial stores precede the release below
            done = tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu")
            if done == num_kv_splits - 1:  # the other splits' partials are visible (acquire)
                sink = tl.zeros(row_valid.shape, dtype=tl.float32)
                if USE_SINKS:
                    sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0) * 1.4426950408889634
                merged = _merge_partials(
                    part_out_ptr, part_lse_ptr, part_base, row_valid, sink, offs_d, d_mask,
                    num_kv_splits, HEAD_DIM, USE_SINKS,
                )  # fmt: skip
                tl.store(out_rows, merged.to(out_ptr.dtype.element_ty), mask=out_mask)
                tl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")  # zero for the next launch
    else:
        tl.store(out_rows, o.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _merge_partials(
    part_out_ptr,
    part_lse_ptr,
    part_base,
    row_mask,
    sink,
    offs_d,
    d_mask,
    num_kv_splits,
    HEAD_DIM: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    """The merged output ``[rows, HEAD_DIM_PAD]`` (fp32) of rows whose splits' partials start
    at ``part_base`` (``[rows]``, in units of one partial): each normalised partial weighted by
    ``2^(lse_j - max_j lse)``, summed over ``j = 0 .. num_kv_splits - 1`` in that order, over
    the sum of the weights; with ``USE_SINKS`` the row's sink logit ``sink`` (log2 units) is
    one more denominator term with no output. Empty splits (``lse = -inf``) weigh 0."""
    lse_max = tl.full(row_mask.shape, float("-inf"), dtype=tl.float32)
    for j in range(num_kv_splits):
        lse = tl.load(part_lse_ptr + part_base + j, mask=row_mask, other=float("-inf"))
        lse_max = tl.maximum(lse_max, lse)
    if USE_SINKS:
        lse_max = tl.maximum(lse_max, sink)
    lse_ref = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w_sum = tl.zeros(row_mask.shape, dtype=tl.float32)
    if USE_SINKS:
        w_sum += tl.exp2(sink - lse_ref)
    acc = tl.zeros([row_mask.shape[0], offs_d.shape[0]], dtype=tl.float32)
    for j in range(num_kv_splits):
        lse = tl.load(part_lse_ptr + part_base + j, mask=row_mask, other=float("-inf"))
        w = tl.exp2(lse - lse_ref)
        part = tl.load(
            part_out_ptr + (part_base + j)[:, None] * HEAD_DIM + offs_d[None, :],
            mask=row_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        w_sum += w
        acc += w[:, None] * part
    return acc / tl.where(w_sum > 0.0, w_sum, 1.0)[:, None]


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    tickets_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    cu_seqlens_q_ptr,
    num_seqs,
    num_q_heads,
    num_kv_splits,
    sliding_window,
    attention_chunk,
    scale_log2,
    softcap_in,
    softcap_out,
    sinks_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_bt,
    k_scale_ptr,
    v_scale_ptr,
    stride_scale_block,
    stride_scale_slot,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TOKENS_PER_TILE: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DECODE_ONLY: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_CHUNK: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_SINKS: tl.constexpr,
    CAUSAL: tl.constexpr,
    SPLIT: tl.constexpr,
    MERGE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    QUANT: tl.constexpr,
):
    pid_q = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)

    seq, tile = _locate_q_tile(cu_seqlens_q_ptr, pid_q, num_seqs, TOKENS_PER_TILE, DECODE_ONLY)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    tile_tok0 = tile * TOKENS_PER_TILE
    if tile_tok0 >= q_len:
        return

    # -- rows: (token, head) pairs of this KV head's group
    offs_m = tl.arange(0, BLOCK_M)
    tok_in_seq = tile_tok0 + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_valid = (offs_m < TOKENS_PER_TILE * GROUP) & (tok_in_seq < q_len)
    token = (q_start + tok_in_seq).to(tl.int64)
    q_pos = seq_len - q_len + tok_in_seq  # absolute position of each row's query token
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM

    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_valid[:, None] & d_mask[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)

    # -- this split's run of key tiles, one online-softmax step each
    kv_lo, kv_hi, tile_begin, tile_end = _bounded_key_tiles(
        seq_len, q_len, tile_tok0, split, num_kv_splits, sliding_window, attention_chunk,
        TOKENS_PER_TILE, TILE_N, USE_WINDOW, USE_CHUNK, CAUSAL,
    )  # fmt: skip
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for t in range(tile_begin, tile_end):
        offs_n = kv_lo + t * TILE_N + tl.arange(0, TILE_N)
        n_valid = offs_n < kv_hi
        k, v = _load_kv_tile(
            k_cache_ptr, v_cache_ptr, table_row, kv_head, offs_n, n_valid, offs_d, d_mask,
            stride_cache_block, stride_cache_slot, stride_cache_head, k_scale_ptr, v_scale_ptr,
            stride_scale_block, stride_scale_slot, q_ptr, BLOCK_SIZE, DOT_FP32, QUANT,
        )  # fmt: skip
        m_i, l_i, acc = _attend_key_tile(
            q, k, v, offs_n, n_valid, q_pos, sliding_window, attention_chunk, scale_log2,
            softcap_in, softcap_out, m_i, l_i, acc, USE_WINDOW, USE_CHUNK, USE_SOFTCAP, CAUSAL,
            DOT_PRECISION,
        )  # fmt: skip
    if USE_SINKS and not SPLIT:  # (split-KV: the merge adds the sink once)
        # the head's sink logit joins the denominator like a key whose value is zero
        sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0) * 1.4426950408889634
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.exp2(sink - m_new)
        acc = acc * alpha[:, None]
        m_i = m_new

    # -- normalise; with split-KV, the partial output and its log-sum-exp go to the workspace
    _store_rows(
        acc, m_i, l_i, row_valid, d_mask, offs_d, token, head, split, num_q_heads,
        num_kv_splits, out_ptr, part_out_ptr, part_lse_ptr, tickets_ptr, sinks_ptr, stride_ot,
        stride_oh, HEAD_DIM, SPLIT, MERGE, USE_SINKS,
    )  # fmt: skip


@triton.jit
def _paged_attention_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    sinks_ptr,
    num_q_heads,
    num_kv_splits,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    h_mask = offs_h < num_q_heads
    d_mask = offs_d < HEAD_DIM
    sink = tl.zeros([BLOCK_H], dtype=tl.float32)
    if USE_SINKS:
        sink = tl.load(sinks_ptr + offs_h, mask=h_mask, other=0.0) * 1.4426950408889634
    o = _merge_partials(
        part_out_ptr, part_lse_ptr, (token * num_q_heads + offs_h) * num_kv_splits, h_mask,
        sink, offs_d, d_mask, num_kv_splits, HEAD_DIM, USE_SINKS,
    )  # fmt: skip
    tl.store(
        out_ptr + token * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=h_mask[:, None] & d_mask[None, :],
    )


@dataclass(frozen=True, slots=True)
class AttentionTiles:
    """Launch settings of ``_paged_attention_kernel``: a fixed function of the shapes.

    ``head_dim_pad``: head dim padded to a power of two >= 16; ``block_m``: rows (query token,
    query head) per program; ``tokens_per_tile = block_m // group``; ``tile_n``: keys per
    inner-loop step; ``num_warps``; ``num_stages``: software-pipelining depth of the key loop;
    ``maxnreg``: registers per thread ptxas may use (None: its own choice).
    """

    head_dim_pad: int
    block_m: int
    tokens_per_tile: int
    tile_n: int
    num_warps: int
    num_stages: int
    maxnreg: int | None


def attention_tiles(
    *, head_dim: int, group: int, decode_only: bool, dtype: torch.dtype, quantized: bool = False
) -> AttentionTiles:
    """Tile sizes for one launch (untuned defaults; never a function of the batch size).

    ``block_m`` is 16 for decode-only batches, else 64 (32 for head dims > 128), raised to the
    group size if larger. fp16/bf16: ``tile_n`` 64 (32 for head dims > 128), 4 warps (8 for head
    dims > 128), Triton's default 3 stages. fp32 (exactness tests) runs its dots as fp32 FMAs,
    not tensor-core MMAs, with every operand tile in registers: ``tile_n`` 16, 16 warps, 2
    stages and ``maxnreg`` 128 (all a 512-thread block can have) build for sm_90 with no spills
    (``ci/aot_compile.py``). Left to itself ptxas gave such builds as few as 32 (fp16's tiles)
    or 64 (these) registers and spilled; 8 warps needed more than 255 registers in some builds.
    A ``quantized`` cache (codes and their converted tile both live) pipelines one stage less
    where the full depth spilled on sm_90: fp32 1 stage (2 spilled 176-956 B), fp16/bf16 at head
    dims > 128 2 stages (3 spilled 8 B with fp8 codes).
    """
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    wide = head_dim_pad > 128
    block_m = 16 if decode_only else (32 if wide else 64)
    block_m = max(block_m, triton.next_power_of_2(group))
    if dtype == torch.float32:
        tile_n, num_warps, num_stages, maxnreg = 16, 16, 2, 128
    else:
        tile_n, num_warps, num_stages, maxnreg = (32 if wide else 64), (8 if wide else 4), 3, None
    if quantized and (dtype == torch.float32 or wide):
        num_stages -= 1
    return AttentionTiles(
        head_dim_pad, block_m, block_m // group, tile_n, num_warps, num_stages, maxnreg
    )


@dataclass(frozen=True, slots=True)
class AttentionLaunch:
    """Everything one ``paged_attention`` call launches with besides its tensors: the grids,
    the kernel's compile-time arguments and its launch options.

    ``dot_fp32``: cast bf16 operands to fp32 before the dots (only under the interpreter, whose
    bf16 ``tl.dot`` is wrong); ``dot_precision``: ``ieee`` whenever the dots see fp32 operands
    (TF32 would cost ~1e-3), else ``tf32``, which fp16/bf16 dots ignore. ``fuse_merge``: with
    split-KV in a decode-only launch, the last split program of each (sequence, KV head) merges
    the partials (one launch, ``num_tickets`` counters) instead of the reduce kernel. Launches
    with prefill chunks, where splits are never chosen automatically, keep the reduce: folded
    in, the merge made the head-dim-256 prefill builds spill on sm_90 (``ci/aot_compile.py``).
    ``causal``: the kernel's ``CAUSAL`` (False: bidirectional encoders). ``quantized``: the
    kernel's ``QUANT``, int8/fp8 caches dequantized as each tile is loaded. ``use_chunk``: the
    kernel's ``USE_CHUNK``, a chunked local attention layer's lower key bound.
    """

    shapes: AttentionShapes
    tiles: AttentionTiles
    num_kv_splits: int
    decode_only: bool
    use_window: bool
    dot_fp32: bool
    dot_precision: str
    use_softcap: bool = False
    use_sinks: bool = False
    fuse_merge: bool = True
    causal: bool = True
    quantized: bool = False
    use_chunk: bool = False

    @property
    def split(self) -> bool:
        return self.num_kv_splits > 1

    @property
    def merge_in_kernel(self) -> bool:
        """Whether the attention kernel merges its own splits (no reduce launch)."""
        return self.split and self.fuse_merge and self.decode_only

    @property
    def num_tickets(self) -> int:
        """int32 counters a fused merge takes: one per (query tile, KV head) program."""
        num_q_tiles, num_kv_heads, _ = self.grid
        return num_q_tiles * num_kv_heads

    @property
    def grid(self) -> tuple[int, int, int]:
        """``(num_q_tiles, Hkv, num_kv_splits)``; see the module docstring for the q tiles."""
        shapes = self.shapes
        if self.decode_only:
            num_q_tiles = shapes.num_seqs
        else:
            num_q_tiles = shapes.num_tokens // self.tiles.tokens_per_tile + shapes.num_seqs
        return num_q_tiles, shapes.num_kv_heads, self.num_kv_splits

    def constexprs(self) -> dict[str, int | bool | str]:
        """The compile-time arguments of ``_paged_attention_kernel``, by name."""
        return dict(
            HEAD_DIM=self.shapes.head_dim,
            HEAD_DIM_PAD=self.tiles.head_dim_pad,
            GROUP=self.shapes.group,
            BLOCK_M=self.tiles.block_m,
            TOKENS_PER_TILE=self.tiles.tokens_per_tile,
            TILE_N=self.tiles.tile_n,
            BLOCK_SIZE=self.shapes.block_size,
            DECODE_ONLY=self.decode_only,
            USE_WINDOW=self.use_window,
            USE_CHUNK=self.use_chunk,
            USE_SOFTCAP=self.use_softcap,
            USE_SINKS=self.use_sinks,
            CAUSAL=self.causal,
            SPLIT=self.split,
            MERGE=self.merge_in_kernel,
            DOT_FP32=self.dot_fp32,
            DOT_PRECISION=self.dot_precision,
            QUANT=self.quantized,
        )

    def options(self) -> dict[str, int | None]:
        """``num_warps``, ``num_stages`` and ``maxnreg`` of ``_paged_attention_kernel``."""
        tiles = self.tiles
        return dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages, maxnreg=tiles.maxnreg)


def attention_launch(
    shapes: AttentionShapes,
    *,
    dtype: torch.dtype,
    max_seqlen_q: int,
    max_seqlen_k: int,
    sliding_window: int | None,
    num_kv_splits: int | None,
    softcap: float | None = None,
    sinks: bool = False,
    num_sms: int = REFERENCE_SMS,
    fuse_merge: bool = True,
    causal: bool = True,
    quantized: bool = False,
    attention_chunk: int | None = None,
) -> AttentionLaunch:
    """The launch settings of one call (``num_kv_splits=None``: :func:`choose_num_kv_splits`
    for a GPU of ``num_sms`` multiprocessors; ``fuse_merge``, ``causal``, ``quantized``: as
    ``AttentionLaunch``; ``attention_chunk`` set: ``use_chunk``). ``dtype`` is q's (a
    quantized cache's tiles reach the dots in it).

    A fixed function of the shapes, dtype and arguments, never of tensor contents.
    """
    if num_kv_splits is None:
        num_kv_splits = choose_num_kv_splits(
            num_seqs=shapes.num_seqs,
            num_kv_heads=shapes.num_kv_heads,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            num_sms=num_sms,
        )
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    decode_only = max_seqlen_q == 1
    dot_fp32 = dtype == torch.bfloat16 and interpreting()
    return AttentionLaunch(
        shapes=shapes,
        tiles=attention_tiles(
            head_dim=shapes.head_dim,
            group=shapes.group,
            decode_only=decode_only,
            dtype=dtype,
            quantized=quantized,
        ),
        num_kv_splits=num_kv_splits,
        decode_only=decode_only,
        use_window=sliding_window is not None,
        dot_fp32=dot_fp32,
        dot_precision="ieee" if dtype == torch.float32 or dot_fp32 else "tf32",
        use_softcap=softcap is not None,
        use_sinks=sinks,
        fuse_merge=fuse_merge,
        causal=causal,
        quantized=quantized,
        use_chunk=attention_chunk is not None,
    )


def choose_num_kv_splits(
    *,
    num_seqs: int,
    num_kv_heads: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    num_sms: int = REFERENCE_SMS,
) -> int:
    """The split-KV factor ``paged_attention`` uses when ``num_kv_splits`` is None.

    FlashAttention's wave-efficiency rule (``num_splits_heuristic``) over our programs, one per
    (sequence, KV head) of a decode-only batch (GQA packing puts a KV head's whole group in one
    program). 1 unless the batch is decode-only (``max_seqlen_q == 1``) and the unsplit launch
    fills less than ``_FULL_ENOUGH`` of the ``num_sms`` multiprocessors. Otherwise, among the
    split counts ``s`` up to ``_MAX_KV_SPLITS`` that leave each split ``_MIN_KEYS_PER_SPLIT``
    keys of the longest context or more (and do not give the same keys per split as ``s - 1``),
    the fewest whose wave efficiency ``w / ceil(w)``, ``w = programs * s / num_sms`` waves, is
    at least ``_EFFICIENCY_SHARE`` of the best: the last wave nearly full, with the fewest
    partial results to merge. A fixed function of shapes and SM count (graph-safe for a given
    ``max_seqlen_k``, which a CUDA-graph caller fixes).
    """
    programs = max(1, num_seqs * num_kv_heads)
    if max_seqlen_q != 1 or programs >= _FULL_ENOUGH * num_sms:
        return 1
    key_blocks = max(1, max_seqlen_k // _MIN_KEYS_PER_SPLIT)
    most = min(_MAX_KV_SPLITS, key_blocks, num_sms)
    if most == 1:
        return 1

    def efficiency(splits: int) -> float:
        waves = programs * splits / num_sms
        return waves / math.ceil(waves)

    def eligible(splits: int) -> bool:  # splitting further must change the keys per split
        return splits == 1 or -(-key_blocks // splits) != -(-key_blocks // (splits - 1))

    candidates = [s for s in range(1, most + 1) if eligible(s)]
    best = max(efficiency(s) for s in candidates)
    return next(s for s in candidates if efficiency(s) >= _EFFICIENCY_SHARE * best)


def workspace_numel(*, num_tokens: int, num_q_heads: int, head_dim: int, num_kv_splits: int) -> int:
    """fp32 elements of split-KV scratch: partial outputs ``[T, Hq, splits, D]`` then LSEs."""
    return num_tokens * num_q_heads * num_kv_splits * (head_dim + 1)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    max_seqlen_q: int,
    max_seqlen_k: int,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    num_kv_splits: int | None = None,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    fuse_merge: bool = True,
    tickets: torch.Tensor | None = None,
    causal: bool = True,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    attention_chunk: int | None = None,
) -> torch.Tensor:
    """Attention of ragged query chunks over the paged KV cache; see ``paged_attention_ref``.

    q: ``[T, Hq, D]``; k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]`` (same dtype as q);
    block_tables: ``[S, max_blocks]`` int32; seq_lens: ``[S]`` int32 (context incl. the new
    tokens); cu_seqlens_q: ``[S + 1]`` int32. ``max_seqlen_q`` / ``max_seqlen_k`` must be the
    true maxima (they size the launch; they are not checked against the device tensors).
    ``softcap`` (> 0) and ``sinks`` (``[Hq]``, any float dtype, on q's device) as in
    ``kernels/interface.py``. ``causal=False``: each query sees every key of its sequence
    (with ``sliding_window`` w, those within ``|k - q| < w``), as ``kernels/interface.py``.
    ``num_kv_splits``: split-KV factor, None = :func:`choose_num_kv_splits`. ``out``: optional
    ``[T, Hq, D]`` output in q's dtype. ``workspace``: optional contiguous fp32 scratch of at
    least :func:`workspace_numel` elements for split-KV (allocated here when omitted).
    ``fuse_merge``: in a decode-only step, split-KV partials merged by the attention kernel's
    last split program per (sequence, KV head) (one launch; the result is bit for bit the
    reduce kernel's); steps with prefill chunks always use the reduce kernel.
    ``tickets``: its counters, contiguous int32 zeros on q's device, at least
    ``AttentionLaunch.num_tickets`` (the number of sequences times KV heads for decode); the
    launch leaves them zero. Omitted: a per-device pool (``runtime.zeroed_tickets``).
    ``k_scale``, ``v_scale``: ``[num_blocks, block_size, Hkv]`` fp32, contiguous (both or
    neither): the caches hold int8 / float8_e4m3fn / float8_e5m2 codes (both the same) and
    every key and value read is ``code * scale`` (``kernels/interface.py``'s layout).
    ``attention_chunk`` C (causal only): a query at ``q`` sees no key before ``q // C * C``.
    Returns ``[T, Hq, D]`` in ``q.dtype``. Invalid arguments raise ``ValueError``
    (``kernels/triton/attention_checks.py``).
    """
    # q: [T, Hq, D]; caches: [num_blocks, block_size, Hkv, D]
    shapes = check_attention_inputs(
        q,
        k_cache,
        v_cache,
        block_tables=block_tables,
        seq_lens=seq_lens,
        cu_seqlens_q=cu_seqlens_q,
        scale=scale,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        sliding_window=sliding_window,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    sinks = check_sinks(sinks, shapes, q.device)
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0, got {softcap}")
    if not isinstance(causal, bool):  # a mask tensor or None here is a caller's mistake
        raise ValueError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
    check_attention_chunk(attention_chunk, causal)
    out = check_out(out, q)
    if shapes.num_tokens == 0 or shapes.num_seqs == 0 or max_seqlen_q == 0:
        return out
    launch = attention_launch(
        shapes,
        dtype=q.dtype,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        sliding_window=sliding_window,
        num_kv_splits=num_kv_splits,
        softcap=softcap,
        sinks=sinks is not None,
        num_sms=multiprocessor_count(q.device),
        fuse_merge=fuse_merge,
        causal=causal,
        quantized=k_scale is not None,
        attention_chunk=attention_chunk,
    )
    if launch.split:
        part_out, part_lse = _partials(workspace, shapes, launch.num_kv_splits, q.device)
    else:
        part_out = part_lse = out  # unused (SPLIT=False)
    tickets = (
        check_tickets(tickets, count=launch.num_tickets, device=q.device)
        if launch.merge_in_kernel
        else seq_lens  # unused (MERGE=False)
    )

    _paged_attention_kernel[launch.grid](
        q,
        k_cache,
        v_cache,
        out,
        part_out,
        part_lse,
        tickets,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        shapes.num_seqs,
        shapes.num_q_heads,
        launch.num_kv_splits,
        sliding_window or 0,
        attention_chunk or 1,
        scale * _LOG2_E,
        scale / softcap if softcap else 0.0,
        softcap * _LOG2_E if softcap else 0.0,
        sinks if sinks is not None else part_lse,  # unused without USE_SINKS
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        k_cache if k_scale is None else k_scale,  # unused without QUANT
        v_cache if v_scale is None else v_scale,
        0 if k_scale is None else k_scale.stride(0),
        0 if k_scale is None else k_scale.stride(1),
        **launch.constexprs(),
        **launch.options(),
    )
    if launch.split and not launch.merge_in_kernel:
        merge_splits(part_out, part_lse, out, num_kv_splits=launch.num_kv_splits, sinks=sinks)
    return out


def merge_splits(
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    out: torch.Tensor,
    *,
    num_kv_splits: int,
    sinks: torch.Tensor | None = None,
) -> None:
    """Merge split-KV partials (``part_out`` ``[T, H, splits, D]``, ``part_lse`` ``[T, H,
    splits]``, fp32, flat) into ``out [T, H, D]`` with ``_paged_attention_reduce_kernel``;
    ``sinks`` (fp32 ``[H]``) join each row's denominator once."""
    num_tokens, num_heads, head_dim = out.shape
    block_h = min(16, triton.next_power_of_2(num_heads))
    _paged_attention_reduce_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        part_out,
        part_lse,
        out,
        sinks if sinks is not None else part_lse,
        num_heads,
        num_kv_splits,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_H=block_h,
        USE_SINKS=sinks is not None,
    )


def _partials(
    workspace: torch.Tensor | None,
    shapes: AttentionShapes,
    num_kv_splits: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV scratch, checked or allocated: partial outputs ``[T, Hq, splits, D]`` and their
    log-sum-exps ``[T, Hq, splits]``, flat views of one fp32 buffer."""
    numel = workspace_numel(
        num_tokens=shapes.num_tokens,
        num_q_heads=shapes.num_q_heads,
        head_dim=shapes.head_dim,
        num_kv_splits=num_kv_splits,
    )
    workspace = check_workspace(workspace, numel=numel, device=device)
    num_lse = numel // (shapes.head_dim + 1)
    return workspace[: numel - num_lse], workspace[numel - num_lse : numel]
