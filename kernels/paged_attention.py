"""Paged attention: ragged prefill chunks and decode tokens over a block-table KV cache.

Semantics are exactly those of :func:`kernels.reference.paged_attention_ref` (read its module
docstring for the KV layout, ragged-query and GQA conventions).

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
* **Head dims** that are not powers of two (80, 96) are padded to the next power of two with
  masked loads; the padded lanes are zero so they add nothing to ``q . k``.

Split-KV (flash-decoding)
-------------------------
With ``num_kv_splits > 1`` the key range of each tile is cut into ``num_kv_splits`` contiguous
runs of key tiles, one program each. Each writes its normalised partial output and its
log-sum-exp (log2 units) to an fp32 workspace, and ``_paged_attention_reduce_kernel`` merges the
partials: ``out = sum_j 2^(lse_j - max lse) * out_j / sum_j 2^(lse_j - max lse)``. Empty runs
write ``lse = -inf`` and drop out of the merge. ``num_kv_splits=None`` picks a value with
:func:`choose_num_kv_splits`, a fixed function of the shapes (no autotuning): only decode-only
batches (``max_seqlen_q == 1``) with too few (sequence, KV head) programs to fill the GPU split.

Grids
-----
* main: ``(num_q_tiles, num_kv_heads, num_kv_splits)``. Decode-only batches use one tile per
  sequence (``num_q_tiles = num_seqs``). Otherwise sequence ``s`` owns the tiles starting at
  ``cu_seqlens_q[s] // TOKENS_PER_TILE + s`` (enough for ``ceil(q_len / TOKENS_PER_TILE)``
  tiles), ``num_q_tiles = num_tokens // TOKENS_PER_TILE + num_seqs``, and a program finds its
  sequence by binary search over ``cu_seqlens_q`` -- no host sync, surplus programs exit.
* reduce (split-KV only): ``(num_tokens, cdiv(num_q_heads, BLOCK_H))``, ``BLOCK_H`` <= 16 heads.

Tiles: ``BLOCK_M`` = 16 rows for decode-only batches, else 64 (32 for head dims > 128), raised
to the group size if larger; ``TILE_N`` = 64 keys (32 for head dims > 128).

Interpreter caveats: Triton 3.9's interpreter computes ``tl.dot`` on raw bf16 operands wrongly,
so under ``TRITON_INTERPRET=1`` bf16 operands are cast to fp32 before the dots. On CUDA, fp32
operands use ``input_precision="ieee"`` (not TF32) so fp32 results match the reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.runtime import check_device, interpreting

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 256
_MAX_GROUP = 128
# Split-KV heuristic: aim for this many programs per launch, never split below this many keys
# per split, and never split more than this.
_TARGET_PROGRAMS = 256
_MIN_KEYS_PER_SPLIT = 512
_MAX_KV_SPLITS = 32
_LOG2_E = 1.4426950408889634


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    cu_seqlens_q_ptr,
    num_seqs,
    num_q_heads,
    num_kv_splits,
    sliding_window,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TOKENS_PER_TILE: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DECODE_ONLY: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_q = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)

    # -- which sequence and which tile of its query tokens this program owns
    if DECODE_ONLY:
        seq = pid_q
        tile = 0
    else:
        # Largest s with cu_seqlens_q[s] // TOKENS_PER_TILE + s <= pid_q (tile starts are
        # non-decreasing in s).
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

    # -- the key range [kv_lo, kv_hi) this tile needs, cut into key tiles and split runs
    last_tok = tl.minimum(q_len, tile_tok0 + TOKENS_PER_TILE) - 1
    kv_hi = seq_len - q_len + last_tok + 1
    if USE_WINDOW:
        kv_lo = tl.maximum(seq_len - q_len + tile_tok0 - sliding_window + 1, 0)
        kv_lo = (kv_lo // TILE_N) * TILE_N
    else:
        kv_lo = 0
    num_tiles = tl.cdiv(kv_hi - kv_lo, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, num_kv_splits)
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for t in range(tile_begin, tile_end):
        offs_n = kv_lo + t * TILE_N + tl.arange(0, TILE_N)
        n_valid = offs_n < kv_hi
        # Only positions < kv_hi <= seq_len are read: free slots (possibly NaN) never are.
        block = tl.load(table_row + offs_n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
        slot = (
            block * stride_cache_block
            + (offs_n % BLOCK_SIZE).to(tl.int64) * stride_cache_slot
            + kv_head * stride_cache_head
        )
        kv_mask = n_valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + slot[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + slot[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        allowed = n_valid[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            allowed = allowed & (offs_n[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(allowed, s, float("-inf"))

        # Online softmax; a row with no allowed key so far keeps m = -inf and uses 0 as its
        # reference so exp2(-inf - m) is 0 rather than NaN.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    has_keys = l_i > 0.0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    out_mask = row_valid[:, None] & d_mask[None, :]
    if SPLIT:
        part_row = (token * num_q_heads + head) * num_kv_splits + split
        tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=out_mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part_row, lse, mask=row_valid)
    else:
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )


@triton.jit
def _paged_attention_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    num_q_heads,
    num_kv_splits,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    h_mask = offs_h < num_q_heads
    d_mask = offs_d < HEAD_DIM
    part_base = (token * num_q_heads + offs_h) * num_kv_splits  # [BLOCK_H]

    # Merge by log-sum-exp: weight each split's normalised output by 2^(lse_j - max_j lse).
    lse_all = tl.load(
        part_lse_ptr + part_base[:, None] + offs_s[None, :],
        mask=h_mask[:, None] & (offs_s < num_kv_splits)[None, :],
        other=float("-inf"),
    )
    lse_max = tl.max(lse_all, 1)
    lse_ref = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM_PAD], dtype=tl.float32)
    for j in range(num_kv_splits):
        lse = tl.load(part_lse_ptr + part_base + j, mask=h_mask, other=float("-inf"))
        w = tl.exp2(lse - lse_ref)  # an empty split has lse = -inf: weight 0
        part = tl.load(
            part_out_ptr + (part_base + j)[:, None] * HEAD_DIM + offs_d[None, :],
            mask=h_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        w_sum += w
        acc += w[:, None] * part
    o = acc / tl.where(w_sum > 0.0, w_sum, 1.0)[:, None]
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
    *, head_dim: int, group: int, decode_only: bool, dtype: torch.dtype
) -> AttentionTiles:
    """Tile sizes for one launch (untuned defaults; never a function of the batch size).

    ``block_m`` is 16 for decode-only batches, else 64 (32 for head dims > 128), raised to the
    group size if larger. fp16/bf16: ``tile_n`` 64 (32 for head dims > 128), 4 warps (8 for head
    dims > 128), Triton's default 3 stages. fp32 (exactness tests) runs its dots as fp32 FMAs,
    not tensor-core MMAs, with every operand tile in registers: ``tile_n`` 16, 16 warps, 2
    stages and ``maxnreg`` 128 (all a 512-thread block can have) build for sm_90 with no spills
    (``ci/aot_compile.py``). Left to itself ptxas gave such builds as few as 32 (fp16's tiles)
    or 64 (these) registers and spilled; 8 warps needed more than 255 registers in some builds.
    """
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    wide = head_dim_pad > 128
    block_m = 16 if decode_only else (32 if wide else 64)
    block_m = max(block_m, triton.next_power_of_2(group))
    if dtype == torch.float32:
        tile_n, num_warps, num_stages, maxnreg = 16, 16, 2, 128
    else:
        tile_n, num_warps, num_stages, maxnreg = (32 if wide else 64), (8 if wide else 4), 3, None
    return AttentionTiles(
        head_dim_pad, block_m, block_m // group, tile_n, num_warps, num_stages, maxnreg
    )


def choose_num_kv_splits(
    *, num_seqs: int, num_kv_heads: int, max_seqlen_q: int, max_seqlen_k: int
) -> int:
    """The split-KV factor ``paged_attention`` uses when ``num_kv_splits`` is None.

    A fixed function of the shapes: 1 unless the batch is decode-only (``max_seqlen_q == 1``)
    and has fewer than ``_TARGET_PROGRAMS`` (sequence, KV head) programs; then enough splits to
    reach that many programs, at most one per ``_MIN_KEYS_PER_SPLIT`` keys of the longest
    context and at most ``_MAX_KV_SPLITS``. A CUDA-graph caller should pass ``num_kv_splits``
    explicitly, since this depends on ``max_seqlen_k``.
    """
    if max_seqlen_q != 1:
        return 1
    programs = max(1, num_seqs * num_kv_heads)
    by_occupancy = -(-_TARGET_PROGRAMS // programs)
    by_length = max_seqlen_k // _MIN_KEYS_PER_SPLIT
    return max(1, min(by_occupancy, by_length, _MAX_KV_SPLITS))


def workspace_numel(*, num_tokens: int, num_q_heads: int, head_dim: int, num_kv_splits: int) -> int:
    """fp32 elements of split-KV scratch: partial outputs ``[T, Hq, splits, D]`` then LSEs."""
    return num_tokens * num_q_heads * num_kv_splits * (head_dim + 1)


def _check_int_tensor(name: str, t: torch.Tensor, ndim: int, device: torch.device) -> None:
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, q is on {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


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
    num_kv_splits: int | None = None,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ragged query chunks over the paged KV cache; see ``paged_attention_ref``.

    q: ``[T, Hq, D]``; k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]`` (same dtype as q);
    block_tables: ``[S, max_blocks]`` int32; seq_lens: ``[S]`` int32 (context incl. the new
    tokens); cu_seqlens_q: ``[S + 1]`` int32. ``max_seqlen_q`` / ``max_seqlen_k`` must be the
    true maxima (they size the launch; they are not checked against the device tensors).
    ``num_kv_splits``: split-KV factor, None = :func:`choose_num_kv_splits`. ``out``: optional
    ``[T, Hq, D]`` output in q's dtype. ``workspace``: optional contiguous fp32 scratch of at
    least :func:`workspace_numel` elements for split-KV (allocated here when omitted).
    Returns ``[T, Hq, D]`` in ``q.dtype``.
    """
    # q: [T, Hq, D]; caches: [num_blocks, block_size, Hkv, D]
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, Hkv, D], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if q.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"q dtype must be one of {_SUPPORTED_DTYPES}, got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(
            f"cache dtypes ({k_cache.dtype}, {v_cache.dtype}) must equal q dtype {q.dtype}"
        )
    device = q.device
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, q is on {device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    check_device(device)
    if q.stride(-1) != 1:
        raise ValueError(f"q's last dim must be contiguous, got strides {q.stride()}")
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"cache head_dim {cache_head_dim} != q head_dim {head_dim}")
    if not 1 <= head_dim <= _MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {_MAX_HEAD_DIM}], got {head_dim}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {num_kv_heads}"
        )
    group = num_q_heads // num_kv_heads
    if group > _MAX_GROUP:
        raise ValueError(f"GQA group {group} exceeds {_MAX_GROUP}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")

    _check_int_tensor("block_tables", block_tables, 2, device)
    _check_int_tensor("seq_lens", seq_lens, 1, device)
    _check_int_tensor("cu_seqlens_q", cu_seqlens_q, 1, device)
    num_seqs = seq_lens.shape[0]
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {num_seqs} seqs")
    if cu_seqlens_q.shape[0] != num_seqs + 1:
        raise ValueError(f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries, need {num_seqs + 1}")
    if max_seqlen_q < 0 or max_seqlen_k < 0:
        raise ValueError(f"max_seqlen_q {max_seqlen_q} / max_seqlen_k {max_seqlen_k} < 0")
    if max_seqlen_k > block_tables.shape[1] * block_size:
        raise ValueError(
            f"max_seqlen_k {max_seqlen_k} exceeds block_tables capacity "
            f"{block_tables.shape[1]} blocks x {block_size}"
        )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")

    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=device)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != device:
        raise ValueError(
            f"out must be {tuple(q.shape)} {q.dtype} on {device}, got "
            f"{tuple(out.shape)} {out.dtype} on {out.device}"
        )
    elif out.stride(-1) != 1:
        raise ValueError(f"out's last dim must be contiguous, got strides {out.stride()}")
    if num_tokens == 0 or num_seqs == 0 or max_seqlen_q == 0:
        return out

    if num_kv_splits is None:
        num_kv_splits = choose_num_kv_splits(
            num_seqs=num_seqs,
            num_kv_heads=num_kv_heads,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
        )
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    split = num_kv_splits > 1
    if split:
        needed = workspace_numel(
            num_tokens=num_tokens,
            num_q_heads=num_q_heads,
            head_dim=head_dim,
            num_kv_splits=num_kv_splits,
        )
        if workspace is None:
            workspace = torch.empty(needed, dtype=torch.float32, device=device)
        elif (
            workspace.dtype != torch.float32
            or workspace.device != device
            or not workspace.is_contiguous()
            or workspace.numel() < needed
        ):
            raise ValueError(
                f"workspace must be contiguous fp32 on {device} with >= {needed} elements, got "
                f"{workspace.dtype} on {workspace.device} with {workspace.numel()}"
            )
        part_out = workspace[: needed - needed // (head_dim + 1)]
        part_lse = workspace[needed - needed // (head_dim + 1) : needed]
    else:
        part_out = part_lse = out  # unused (SPLIT=False)

    decode_only = max_seqlen_q == 1
    tiles = attention_tiles(head_dim=head_dim, group=group, decode_only=decode_only, dtype=q.dtype)
    num_q_tiles = num_seqs if decode_only else num_tokens // tiles.tokens_per_tile + num_seqs
    dot_fp32 = q.dtype == torch.bfloat16 and interpreting()
    fp32_operands = q.dtype == torch.float32 or dot_fp32

    _paged_attention_kernel[(num_q_tiles, num_kv_heads, num_kv_splits)](
        q,
        k_cache,
        v_cache,
        out,
        part_out,
        part_lse,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        num_seqs,
        num_q_heads,
        num_kv_splits,
        sliding_window or 0,
        scale * _LOG2_E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=tiles.head_dim_pad,
        GROUP=group,
        BLOCK_M=tiles.block_m,
        TOKENS_PER_TILE=tiles.tokens_per_tile,
        TILE_N=tiles.tile_n,
        BLOCK_SIZE=block_size,
        DECODE_ONLY=decode_only,
        USE_WINDOW=sliding_window is not None,
        SPLIT=split,
        DOT_FP32=dot_fp32,
        DOT_PRECISION="ieee" if fp32_operands else "tf32",
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        maxnreg=tiles.maxnreg,
    )
    if split:
        block_h = min(16, triton.next_power_of_2(num_q_heads))
        _paged_attention_reduce_kernel[(num_tokens, triton.cdiv(num_q_heads, block_h))](
            part_out,
            part_lse,
            out,
            num_q_heads,
            num_kv_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=tiles.head_dim_pad,
            BLOCK_H=block_h,
            SPLITS_PAD=triton.next_power_of_2(num_kv_splits),
        )
    return out
