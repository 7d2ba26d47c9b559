"""Multi-head latent attention (MLA) over a paged latent cache, with absorbed weights.

Semantics are exactly those of :func:`paged_serve.kernels.reference.mla_attention_ref`. DeepSeek's
MLA caches one entry per token, ``[kv_lora_rank + rope_dim]``: the normalised latent ``c`` (the
first ``R = kv_lora_rank`` lanes) and the shared rotated key part ``k_rope``. With the key and
value up-projections absorbed (the caller multiplies ``q_nope`` by ``W_UK`` before and the
output by ``W_UV`` after), every query head attends over the same entries: the score of head
``h`` against a token is ``q_h . entry`` over all ``R + rope_dim`` lanes, and the value is the
latent ``entry[:R]``. It is multi-query attention with one cache "head" whose values are the
first ``R`` lanes of its keys, so each cache tile is loaded once for a whole block of heads.

Algorithm: FlashAttention-2's online softmax (fp32 running max, sum and accumulator; scores in
log2 units), as in ``kernels/triton/paged_attention.py``, whose helpers it shares: the same
query-tile search over ``cu_seqlens_q`` (``_locate_q_tile``), the same causal key range and
split runs (``_key_tiles``), online-softmax step (``_online_softmax_step``), row store
(``_store_rows``) and split-KV merge (``_merge_partials``, folded into the kernel by default;
``merge_splits`` with ``fuse_merge=False``).

* **Rows.** A program owns ``BLOCK_H`` query heads of ``TOKENS_PER_TILE`` tokens: row ``r`` is
  token ``r // BLOCK_H`` of the tile and head ``head_block * BLOCK_H + r % BLOCK_H``. Decode-only
  batches take one token per tile; rows are padded to 16 for ``tl.dot`` and masked.
* **Lanes.** The latent and the rope part are separate tiles (``LATENT_PAD``, ``ROPE_PAD``: each
  rounded up to a power of two and masked), so a 512 + 64 entry is not padded to 1024. The
  score is ``q_latent . c + q_rope . k_rope``; the accumulator is ``[rows, LATENT_PAD]``.
* **Paging and masking** as in paged attention: positions ``>= seq_len`` are never loaded, so
  free (NaN) slots cannot reach the result; causal masking inside a chunk.
* **Split-KV** (flash-decoding): ``num_kv_splits > 1`` cuts each key range into runs, one
  program each, writing normalised partials and log-sum-exps to an fp32 workspace; in a
  decode-only launch the last split program of each (sequence, head block) merges them (one
  ticket each); with prefill chunks, or ``fuse_merge=False``, the reduce kernel does.
  ``num_kv_splits=None`` chooses with
  :func:`paged_serve.kernels.triton.paged_attention.choose_num_kv_splits`, counting ``(sequence,
  head block)`` programs.

Grids: main ``(num_q_tiles, cdiv(H, BLOCK_H), num_kv_splits)`` (``num_q_tiles`` as in paged
attention); reduce (prefill chunks or ``fuse_merge=False``) ``(T, cdiv(H, 16))``.

* **Quantized cache** (``latent_scale`` given: int8 / fp8 codes, one fp32 scale per token;
  ``kernels/interface.py``'s ``WriteLatent``). The compile-time ``QUANT`` switch loads, beside
  each tile of codes, its ``[TILE_N]`` scales, and the codes go to the dots as they are (cast to
  q's dtype, which holds every code exactly). Entry ``n`` is ``code * scale[n]``, so its score
  is ``(q . code) * scale[n]`` and its value term ``p * scale[n] * code``: the scales multiply
  the scores' columns and the softmax weights (over the tile's largest scale, then the dot's
  result by it: ``_scaled_softmax_step``). No dequantized copy of the cache or of a tile is
  made.

Under ``TRITON_INTERPRET=1`` bf16 operands are cast to fp32 before the dots (the interpreter's
bf16 ``tl.dot`` is wrong); fp32 dots use ``input_precision="ieee"`` on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import triton
import triton.language as tl
from paged_serve.kernels.triton.attention_checks import (
    KV_CODE_DTYPES,
    SUPPORTED_DTYPES,
    check_step_bounds,
    check_step_metadata,
    check_tickets,
    check_workspace,
)
from paged_serve.kernels.triton.paged_attention import (
    _key_tiles,
    _locate_q_tile,
    _online_softmax_step,
    _store_rows,
    choose_num_kv_splits,
    merge_splits,
)
from paged_serve.kernels.triton.runtime import check_device, interpreting, multiprocessor_count

_LOG2_E = 1.4426950408889634
MAX_LATENT_DIM = 1024
MAX_ROPE_DIM = 256


@triton.jit
def _scaled_softmax_step(s, codes, entry_scale, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """``_online_softmax_step`` over a quantized tile: the values are ``codes [TILE_N,
    LATENT_PAD]`` times ``entry_scale [TILE_N]`` (fp32, 0 for unloaded entries), folded into
    the softmax weights rather than the codes. The weights are multiplied by the scales over
    the tile's largest scale (each factor in [0, 1], so fp16 weights keep their precision) and
    the dot by that largest scale."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    top = tl.max(entry_scale, 0)
    top = tl.where(top > 0.0, top, 1.0)
    weights = p * (entry_scale / top)[None, :]
    pv = tl.dot(weights.to(codes.dtype), codes, input_precision=DOT_PRECISION)
    acc = acc * alpha[:, None] + pv * top
    return m_new, l_i, acc


@triton.jit
def _mla_attention_kernel(
    q_ptr,
    cache_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    tickets_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    cu_seqlens_q_ptr,
    num_seqs,
    num_heads,
    num_kv_splits,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cache_block,
    stride_cache_slot,
    stride_bt,
    latent_scale_ptr,
    stride_scale_block,
    LATENT: tl.constexpr,
    ROPE: tl.constexpr,
    LATENT_PAD: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TOKENS_PER_TILE: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DECODE_ONLY: tl.constexpr,
    SPLIT: tl.constexpr,
    MERGE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    QUANT: tl.constexpr = False,
):
    pid_q = tl.program_id(0)
    head_block = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)

    seq, tile = _locate_q_tile(cu_seqlens_q_ptr, pid_q, num_seqs, TOKENS_PER_TILE, DECODE_ONLY)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    tile_tok0 = tile * TOKENS_PER_TILE
    if tile_tok0 >= q_len:
        return

    # -- rows: (token, head) pairs of this head block
    offs_m = tl.arange(0, BLOCK_M)
    tok_in_seq = tile_tok0 + offs_m // BLOCK_H
    head = head_block * BLOCK_H + offs_m % BLOCK_H
    row_valid = (offs_m < TOKENS_PER_TILE * BLOCK_H) & (tok_in_seq < q_len) & (head < num_heads)
    token = (q_start + tok_in_seq).to(tl.int64)
    q_pos = seq_len - q_len + tok_in_seq
    offs_c = tl.arange(0, LATENT_PAD)
    offs_r = tl.arange(0, ROPE_PAD)
    c_mask = offs_c < LATENT
    r_mask = offs_r < ROPE

    q_row = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
    q_lat = tl.load(q_row + offs_c[None, :], mask=row_valid[:, None] & c_mask[None, :], other=0.0)
    q_rope = tl.load(
        q_row + LATENT + offs_r[None, :], mask=row_valid[:, None] & r_mask[None, :], other=0.0
    )
    if DOT_FP32:
        q_lat = q_lat.to(tl.float32)
        q_rope = q_rope.to(tl.float32)

    kv_lo, kv_hi, tile_begin, tile_end = _key_tiles(  # no window (False), causal (True)
        seq_len, q_len, tile_tok0, split, num_kv_splits, 0, TOKENS_PER_TILE, TILE_N, False, True
    )
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, LATENT_PAD], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for t in range(tile_begin, tile_end):
        offs_n = kv_lo + t * TILE_N + tl.arange(0, TILE_N)
        n_valid = offs_n < kv_hi
        block = tl.load(table_row + offs_n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
        slot = block * stride_cache_block + (offs_n % BLOCK_SIZE).to(tl.int64) * stride_cache_slot
        c = tl.load(
            cache_ptr + slot[:, None] + offs_c[None, :],
            mask=n_valid[:, None] & c_mask[None, :],
            other=0.0,
        )
        k_rope = tl.load(
            cache_ptr + slot[:, None] + LATENT + offs_r[None, :],
            mask=n_valid[:, None] & r_mask[None, :],
            other=0.0,
        )
        if DOT_FP32:
            c = c.to(tl.float32)
            k_rope = k_rope.to(tl.float32)
        elif QUANT:  # codes reach the dots in q's dtype (exact: every code is representable)
            c = c.to(q_ptr.dtype.element_ty)
            k_rope = k_rope.to(q_ptr.dtype.element_ty)
        s = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
        s += tl.dot(q_rope, tl.trans(k_rope), input_precision=DOT_PRECISION)
        if QUANT:
            # scales [num_blocks, block_size]: entry n is codes * scale[n], so is its score
            scale_slot = block * stride_scale_block + (offs_n % BLOCK_SIZE).to(tl.int64)
            entry_scale = tl.load(latent_scale_ptr + scale_slot, mask=n_valid, other=0.0)
            s = s * (entry_scale * scale_log2)[None, :]
        else:
            s = s * scale_log2
        allowed = n_valid[None, :] & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(allowed, s, float("-inf"))
        if QUANT:
            m_i, l_i, acc = _scaled_softmax_step(s, c, entry_scale, m_i, l_i, acc, DOT_PRECISION)
        else:
            m_i, l_i, acc = _online_softmax_step(s, c, m_i, l_i, acc, DOT_PRECISION)

    _store_rows(
        acc, m_i, l_i, row_valid, c_mask, offs_c, token, head, split, num_heads, num_kv_splits,
        out_ptr, part_out_ptr, part_lse_ptr, tickets_ptr, part_lse_ptr, stride_ot, stride_oh,
        LATENT, SPLIT, MERGE, False,
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class MlaShapes:
    """The sizes of one call: ``q [T, H, R + rope]``, cache ``[num_blocks, block_size, R +
    rope]``, ``S`` sequences."""

    num_tokens: int
    num_heads: int
    kv_lora_rank: int
    rope_dim: int
    block_size: int
    num_seqs: int


@dataclass(frozen=True, slots=True)
class MlaLaunch:
    """Every launch setting of one call, a fixed function of the shapes and dtype.

    ``block_h``: query heads per program (16, fewer for fewer heads); ``tokens_per_tile``: 1 for
    decode-only batches, else enough tokens for 64 rows (16 for latents wider than 256 lanes,
    whose fp32 accumulator would not fit the registers: ``ci/aot_compile.py``); ``block_m`` =
    rows, at least 16; ``tile_n``: cache entries per inner step (32, 16 for wide latents).
    ``quantized``: the cache holds codes (``QUANT``); with fp32 q such a launch is not software
    pipelined (``num_stages`` 1) and may use 168 registers (``maxnreg``): without them it
    spilled, some 5 KB, at DeepSeek-V3's shape.
    """

    shapes: MlaShapes
    num_kv_splits: int
    decode_only: bool
    block_h: int
    tokens_per_tile: int
    block_m: int
    tile_n: int
    num_warps: int
    dot_fp32: bool
    dot_precision: str
    fuse_merge: bool = True
    quantized: bool = False
    num_stages: int | None = None  # None: Triton's default pipeline depth
    maxnreg: int | None = None  # registers per thread ptxas may use (None: its own choice)

    @property
    def split(self) -> bool:
        return self.num_kv_splits > 1

    @property
    def merge_in_kernel(self) -> bool:
        """Whether the kernel merges its own splits (as paged attention's ``fuse_merge``)."""
        return self.split and self.fuse_merge and self.decode_only

    @property
    def num_tickets(self) -> int:
        """int32 counters a fused merge takes: one per (query tile, head block) program."""
        return self.grid[0] * self.head_blocks

    @property
    def head_blocks(self) -> int:
        return triton.cdiv(self.shapes.num_heads, self.block_h)

    @property
    def grid(self) -> tuple[int, int, int]:
        shapes = self.shapes
        if self.decode_only:
            num_q_tiles = shapes.num_seqs
        else:
            num_q_tiles = shapes.num_tokens // self.tokens_per_tile + shapes.num_seqs
        return num_q_tiles, self.head_blocks, self.num_kv_splits

    def options(self) -> dict[str, int]:
        """The launch's compile options: warps, and the pipeline depth and register cap where
        they are set."""
        options = {"num_warps": self.num_warps}
        if self.num_stages is not None:
            options["num_stages"] = self.num_stages
        if self.maxnreg is not None:
            options["maxnreg"] = self.maxnreg
        return options

    def constexprs(self) -> dict[str, int | bool | str]:
        shapes = self.shapes
        return dict(
            LATENT=shapes.kv_lora_rank,
            ROPE=shapes.rope_dim,
            LATENT_PAD=max(16, triton.next_power_of_2(shapes.kv_lora_rank)),
            ROPE_PAD=max(16, triton.next_power_of_2(shapes.rope_dim)),
            BLOCK_H=self.block_h,
            BLOCK_M=self.block_m,
            TOKENS_PER_TILE=self.tokens_per_tile,
            TILE_N=self.tile_n,
            BLOCK_SIZE=shapes.block_size,
            DECODE_ONLY=self.decode_only,
            SPLIT=self.split,
            MERGE=self.merge_in_kernel,
            DOT_FP32=self.dot_fp32,
            DOT_PRECISION=self.dot_precision,
            QUANT=self.quantized,
        )


def mla_launch(
    shapes: MlaShapes,
    *,
    dtype: torch.dtype,
    max_seqlen_q: int,
    max_seqlen_k: int,
    num_kv_splits: int | None,
    num_sms: int,
    fuse_merge: bool = True,
    quantized: bool = False,
) -> MlaLaunch:
    """The launch settings of one call (``num_kv_splits=None``: chosen as paged attention
    chooses, one program per (sequence, head block); ``fuse_merge``: the kernel merges its
    splits, as paged attention's; ``quantized``: the cache holds codes, the kernel's
    ``QUANT``)."""
    decode_only = max_seqlen_q == 1
    wide = shapes.kv_lora_rank > 256
    block_h = min(16, triton.next_power_of_2(shapes.num_heads))
    rows = 16 if wide else 64  # a wide latent's [rows, R] fp32 accumulator must fit registers
    tokens_per_tile = 1 if decode_only else max(1, rows // block_h)
    block_m = max(16, tokens_per_tile * block_h)
    if num_kv_splits is None:
        num_kv_splits = choose_num_kv_splits(
            num_seqs=shapes.num_seqs,
            num_kv_heads=triton.cdiv(shapes.num_heads, block_h),
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            num_sms=num_sms,
        )
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    dot_fp32 = dtype == torch.bfloat16 and interpreting()
    return MlaLaunch(
        shapes=shapes,
        num_kv_splits=num_kv_splits,
        decode_only=decode_only,
        block_h=block_h,
        tokens_per_tile=tokens_per_tile,
        block_m=block_m,
        tile_n=16 if wide else 32,
        num_warps=8 if wide else 4,
        dot_fp32=dot_fp32,
        dot_precision="ieee" if dtype == torch.float32 or dot_fp32 else "tf32",
        fuse_merge=fuse_merge,
        quantized=quantized,
        # fp32 over codes (ci/aot_compile.py, DeepSeek-V3's shape): the default depth spilled
        # 5 KB (ptxas kept 32 registers), and split decode 8 B at ptxas' own cap of 128
        num_stages=1 if quantized and dtype == torch.float32 else None,
        maxnreg=168 if quantized and dtype == torch.float32 else None,
    )


def mla_workspace_numel(
    *, num_tokens: int, num_heads: int, kv_lora_rank: int, num_kv_splits: int
) -> int:
    """fp32 elements of split-KV scratch: partial outputs ``[T, H, splits, R]`` then LSEs."""
    return num_tokens * num_heads * num_kv_splits * (kv_lora_rank + 1)


def check_mla_inputs(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    *,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    latent_scale: torch.Tensor | None = None,
) -> MlaShapes:
    """ValueError naming what is wrong with the arguments; the sizes when nothing is."""
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, kv_lora_rank + rope_dim], got {tuple(q.shape)}")
    if latent_cache.dim() != 3:
        raise ValueError(
            "latent_cache must be [num_blocks, block_size, kv_lora_rank + rope_dim], got "
            f"{tuple(latent_cache.shape)}"
        )
    num_tokens, num_heads, width = q.shape
    _, block_size, cache_width = latent_cache.shape
    if cache_width != width:
        raise ValueError(f"cache entries are {cache_width} wide, q rows {width}")
    if not 1 <= kv_lora_rank < width:
        raise ValueError(f"kv_lora_rank must be in [1, {width}), got {kv_lora_rank}")
    rope_dim = width - kv_lora_rank
    if kv_lora_rank > MAX_LATENT_DIM or rope_dim > MAX_ROPE_DIM:
        raise ValueError(
            f"latent {kv_lora_rank} / rope {rope_dim} lanes exceed {MAX_LATENT_DIM} / "
            f"{MAX_ROPE_DIM}"
        )
    if latent_scale is not None:
        _check_latent_scale(q, latent_cache, latent_scale)
    elif q.dtype not in SUPPORTED_DTYPES or latent_cache.dtype != q.dtype:
        raise ValueError(
            f"q ({q.dtype}) and latent_cache ({latent_cache.dtype}) must share one of "
            f"{SUPPORTED_DTYPES}"
        )
    if latent_cache.device != q.device:
        raise ValueError(f"latent_cache is on {latent_cache.device}, q is on {q.device}")
    check_device(q.device)
    if latent_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q's and latent_cache's last dims must be contiguous")
    if latent_cache.stride(0) != block_size * latent_cache.stride(1):
        raise ValueError("latent_cache's blocks must be contiguous runs of slots")
    if num_heads < 1 or block_size < 1:
        raise ValueError(f"need heads and block_size >= 1, got {num_heads}, {block_size}")
    num_seqs = check_step_metadata(block_tables, seq_lens, cu_seqlens_q, q.device)
    check_step_bounds(
        block_tables, block_size, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, scale=scale
    )
    return MlaShapes(num_tokens, num_heads, kv_lora_rank, rope_dim, block_size, num_seqs)


def _check_latent_scale(
    q: torch.Tensor, latent_cache: torch.Tensor, latent_scale: torch.Tensor
) -> None:
    """ValueError unless a quantized call is well formed: q of a supported float dtype, the
    cache of int8/fp8 codes, ``latent_scale`` fp32 ``[num_blocks, block_size]``, contiguous, on
    q's device."""
    if q.dtype not in SUPPORTED_DTYPES or latent_cache.dtype not in KV_CODE_DTYPES:
        raise ValueError(
            f"a quantized latent cache (latent_scale given) holds one of {KV_CODE_DTYPES} codes "
            f"and q one of {SUPPORTED_DTYPES}, got {latent_cache.dtype} and {q.dtype}"
        )
    shape = tuple(latent_cache.shape[:2])
    if tuple(latent_scale.shape) != shape or latent_scale.dtype != torch.float32:
        raise ValueError(
            f"latent_scale must be fp32 {shape} (one scale per slot), got {latent_scale.dtype} "
            f"{tuple(latent_scale.shape)}"
        )
    if latent_scale.device != q.device or not latent_scale.is_contiguous():
        raise ValueError(
            f"latent_scale must be contiguous on {q.device}, got {latent_scale.device}"
        )


def mla_attention(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    *,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    num_kv_splits: int | None = None,
    workspace: torch.Tensor | None = None,
    fuse_merge: bool = True,
    tickets: torch.Tensor | None = None,
    latent_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed-query attention over the paged latent cache; see ``mla_attention_ref``.

    q: ``[T, H, R + rope]`` (``q_nope @ W_UK`` then the rotated ``q_rope``); latent_cache:
    ``[num_blocks, block_size, R + rope]`` (slot strides free within a block row); metadata as
    in ``paged_attention``. ``scale``: the model's softmax scale. Returns ``[T, H, R]`` latent
    outputs in q's dtype (the caller applies ``W_UV``). ``workspace``: optional contiguous
    fp32 scratch of at least :func:`mla_workspace_numel` elements for split-KV.
    ``fuse_merge`` / ``tickets``: as in ``paged_attention`` (one counter per (query tile, head
    block): ``MlaLaunch.num_tickets``). ``latent_scale``: ``[num_blocks, block_size]`` fp32,
    contiguous: the cache holds int8 / fp8 codes and entry ``n`` reads as ``code * scale[n]``,
    the scale applied to its scores and its softmax weight (the codes are never dequantized
    into a copy).
    """
    shapes = check_mla_inputs(
        q,
        latent_cache,
        block_tables=block_tables,
        seq_lens=seq_lens,
        cu_seqlens_q=cu_seqlens_q,
        scale=scale,
        kv_lora_rank=kv_lora_rank,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        latent_scale=latent_scale,
    )
    out = torch.empty(
        (shapes.num_tokens, shapes.num_heads, kv_lora_rank), dtype=q.dtype, device=q.device
    )
    if shapes.num_tokens == 0 or shapes.num_seqs == 0 or max_seqlen_q == 0:
        return out
    launch = mla_launch(
        shapes,
        dtype=q.dtype,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        num_kv_splits=num_kv_splits,
        num_sms=multiprocessor_count(q.device),
        fuse_merge=fuse_merge,
        quantized=latent_scale is not None,
    )
    if launch.split:
        numel = mla_workspace_numel(
            num_tokens=shapes.num_tokens,
            num_heads=shapes.num_heads,
            kv_lora_rank=kv_lora_rank,
            num_kv_splits=launch.num_kv_splits,
        )
        workspace = check_workspace(workspace, numel=numel, device=q.device)
        num_lse = numel // (kv_lora_rank + 1)
        part_out, part_lse = workspace[: numel - num_lse], workspace[numel - num_lse : numel]
    else:
        part_out = part_lse = out  # unused (SPLIT=False)
    tickets = (
        check_tickets(tickets, count=launch.num_tickets, device=q.device)
        if launch.merge_in_kernel
        else seq_lens  # unused (MERGE=False)
    )
    _mla_attention_kernel[launch.grid](
        q,
        latent_cache,
        out,
        part_out,
        part_lse,
        tickets,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        shapes.num_seqs,
        shapes.num_heads,
        launch.num_kv_splits,
        scale * _LOG2_E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        latent_cache.stride(0),
        latent_cache.stride(1),
        block_tables.stride(0),
        latent_cache if latent_scale is None else latent_scale,  # unused without QUANT
        0 if latent_scale is None else latent_scale.stride(0),
        **launch.constexprs(),
        **launch.options(),
    )
    if launch.split and not launch.merge_in_kernel:
        merge_splits(part_out, part_lse, out, num_kv_splits=launch.num_kv_splits)
    return out
