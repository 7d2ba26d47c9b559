"""Split-row fused sampling: each row over many programs, for vocabularies larger than a slice.

The one-program-per-row kernel (``kernels/triton/sampling.py``) streams a row 3 to 19 times
from one program, so a batch of one keeps one multiprocessor busy. Here a row of ``V`` tokens is
cut into ``P = ceil(V / SLICE)`` slices of ``SLICE`` columns, one program per (row, slice), and
the passes of the one-program kernel become launches of one kernel (``PHASE``), each program
doing its slice of the pass and the per-row merges the next launch needs:

======== ==================================================================================
phase    each (row, slice) program
======== ==================================================================================
MAX      max, first argmax and NaN / +inf count of the raw logits in its slice
SUMS     merge the maxima; its slice's softmax denominators (raw and ``logits / T``)
TOPK r   merge the sums; merge the slices' level ``r - 1`` histograms and take that digit of
         the top-k radix select (``_top_k_step``); its slice's level-``r`` histogram (r = 0..7)
TOPP r   the same walk over ``p`` with per-bin mass, restricted to the top-k set (``_top_p_step``;
         the target ``top_p * mass(top-k set)`` from the merged level-0 mass)
RACE     the keep mask and the exponential race over its slice: best value and first index
FINAL    (one program per row) the slices' races merged (lowest slice wins ties), the token
         and its logprob
======== ==================================================================================

Every program of a launch merges the same slices' partials in the same order, so all hold the
same per-row values; slice 0 writes the walk's state for the next launch (state and histograms
are kept per level, so no launch reads what another program of it writes). The semantics are
the one-program kernel's (``reference.sample_ref``): the same keep rules, the radix walks'
exact thresholds, the same Philox uniforms per (seed, step, token), the same tie rules (first
argmax; earlier slices before later ones). Only the softmax denominators are summed in another
order (per slice, then over slices). ``P`` depends on the vocabulary only, never on the batch,
so a row's arithmetic is the same in any batch.

Grid: ``(B, P)`` for every phase but FINAL's ``(B, 1)``; 20 launches. ``BLOCK_V`` = min(SLICE,
1024) columns per chunk.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl
from paged_serve.kernels.triton.sampling_passes import (
    _NUM_WARPS,
    _digit_histogram,
    _div,
    _load_chunk,
    _max_pass,
    _race_values,
    _running_argmax,
    _sums_pass,
    _top_k_step,
    _top_p_step,
)

SLICE = 4096  # columns per program: 38 programs per row at V = 151936, 12 at 49152
_MAX_BLOCK_V = 1024
MAX, SUMS, TOPK, TOPP, RACE, FINAL = range(6)
LEVELS = 8  # radix digits of 4 bits in a 32-bit key
_LEVELS = tl.constexpr(LEVELS)  # the same, for the kernel


@triton.jit
def _merged_stats(
    part_max_ptr, part_arg_ptr, part_bad_ptr, part_sum_x_ptr, part_sum_z_ptr, base, slices,
    s_ok, temp, WITH_SUMS: tl.constexpr,
):  # fmt: skip
    """The row's max, first argmax, validity and (``WITH_SUMS``) denominators from its slices'
    partials ``[1, P]`` at ``base + slice``."""
    pm = tl.load(part_max_ptr + base + slices, mask=s_ok, other=float("-inf"))
    pa = tl.load(part_arg_ptr + base + slices, mask=s_ok, other=0)
    pb = tl.load(part_bad_ptr + base + slices, mask=s_ok, other=0)
    x_max = tl.max(pm, 1)
    first = tl.argmax(pm, 1, tie_break_left=True)  # earlier slices win ties
    greedy = tl.sum(tl.where(slices == first[:, None], pa, 0), 1)
    invalid = (tl.sum(pb, 1) > 0) | (x_max == float("-inf"))
    x_ref = tl.where(x_max == float("-inf"), 0.0, x_max)
    z_max = _div(x_ref, temp)
    sum_x = tl.zeros_like(x_ref)
    sum_z = tl.zeros_like(x_ref) + 1.0
    if WITH_SUMS:
        sum_x = tl.sum(tl.load(part_sum_x_ptr + base + slices, mask=s_ok, other=0.0), 1)
        sum_z = tl.sum(tl.load(part_sum_z_ptr + base + slices, mask=s_ok, other=0.0), 1)
        sum_z = tl.where(sum_z > 0.0, sum_z, 1.0)
    return greedy, invalid, x_ref, z_max, sum_x, sum_z


@triton.jit
def _merged_histogram(count_ptr, mass_ptr, base, slices, s_ok, OF_P: tl.constexpr):
    """A level's ``[1, 16]`` counts (and masses) summed over the row's slices."""
    digits = tl.arange(0, 16)
    offs = (base + slices)[:, :, None] * 16 + digits[None, None, :]
    count = tl.sum(tl.load(count_ptr + offs, mask=s_ok[:, :, None], other=0), 1)
    mass = tl.zeros(count.shape, dtype=tl.float32)
    if OF_P:
        mass = tl.sum(tl.load(mass_ptr + offs, mask=s_ok[:, :, None], other=0.0), 1)
    return count, mass


@triton.jit
def _sample_split_kernel(
    logits_ptr,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    seeds_ptr,
    steps_ptr,
    tokens_ptr,
    logprobs_ptr,
    token_mask_ptr,
    part_max_ptr,  # f32 [B, P]
    part_arg_ptr,  # i32 [B, P]
    part_bad_ptr,  # i32 [B, P]
    part_sum_x_ptr,  # f32 [B, P]
    part_sum_z_ptr,  # f32 [B, P]
    k_count_ptr,  # i32 [LEVELS, B, P, 16]
    p_count_ptr,  # i32 [LEVELS, B, P, 16]
    p_mass_ptr,  # f32 [LEVELS, B, P, 16]
    k_state_ptr,  # i32 [LEVELS, 2, B]: prefix bits, rank still to find
    p_state_ptr,  # i32 [LEVELS, 2, B]: prefix bits, nothing kept
    p_mass_above_ptr,  # f32 [LEVELS, B]
    target_ptr,  # f32 [B]
    race_ptr,  # f32 [B, P]
    race_idx_ptr,  # i32 [B, P]
    num_rows,
    vocab_size,
    stride_row,
    stride_mask_row,
    num_slices,
    slice_len,
    PHASE: tl.constexpr,
    LEVEL: tl.constexpr,
    P_POW2: tl.constexpr,
    BLOCK_V: tl.constexpr,
    HAS_MASK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    piece = tl.program_id(1)
    rows = row + tl.arange(0, 1)
    row_mask = rows < num_rows
    row_ptr = logits_ptr + rows * stride_row
    mask_row_ptr = token_mask_ptr + rows * stride_mask_row
    cols = tl.arange(0, BLOCK_V)
    v_lo = piece * slice_len
    v_hi = tl.minimum(v_lo + slice_len, vocab_size)
    slices = tl.arange(0, P_POW2)[None, :]
    s_ok = slices < num_slices
    base = rows[:, None] * num_slices  # [1, 1]: this row's first partial
    mine = rows * num_slices + piece  # [1]: this program's partial
    first_slice = (tl.zeros([1], dtype=tl.int32) + piece) == 0  # slice 0 writes row state
    bpn = num_rows * num_slices * 16  # one level of a histogram buffer

    temperature = tl.load(temperature_ptr + rows)
    temp = tl.where(temperature > 0.0, temperature, 1.0)
    top_k = tl.load(top_k_ptr + rows)
    top_p = tl.load(top_p_ptr + rows)
    k_on = (top_k > 0) & (top_k < vocab_size)
    p_on = top_p < 1.0

    if PHASE == 0:  # MAX
        x_max, greedy, num_bad = _max_pass(
            row_ptr, mask_row_ptr, row_mask, cols, vocab_size, v_lo, v_hi, HAS_MASK, 1, BLOCK_V
        )
        tl.store(part_max_ptr + mine, x_max)
        tl.store(part_arg_ptr + mine, greedy)
        tl.store(part_bad_ptr + mine, num_bad)
        return

    greedy, invalid, x_ref, z_max, sum_x, sum_z = _merged_stats(
        part_max_ptr, part_arg_ptr, part_bad_ptr, part_sum_x_ptr, part_sum_z_ptr, base, slices,
        s_ok, temp, PHASE > 1,
    )  # fmt: skip
    if PHASE == 1:  # SUMS
        sx, sz = _sums_pass(
            row_ptr, mask_row_ptr, row_mask, cols, vocab_size, v_lo, v_hi, temp, x_ref, z_max,
            HAS_MASK, 1, BLOCK_V,
        )  # fmt: skip
        tl.store(part_sum_x_ptr + mine, sx)
        tl.store(part_sum_z_ptr + mine, sz)
        return

    # The top-k walk's state before digit LEVEL (TOPK), or its result (later phases).
    k_prefix = tl.zeros([1], dtype=tl.uint32)
    k_rem = tl.where(k_on, top_k, 1)
    k_level = LEVEL if PHASE == 2 else _LEVELS
    if k_level > 0:
        prev = k_level - 1
        if prev > 0:
            k_prefix = tl.load(k_state_ptr + (prev * 2) * num_rows + rows).to(
                tl.uint32, bitcast=True
            )
            k_rem = tl.load(k_state_ptr + (prev * 2 + 1) * num_rows + rows)
        hist, _ = _merged_histogram(
            k_count_ptr + prev * bpn, k_count_ptr, base, slices, s_ok, False
        )
        k_prefix, k_rem = _top_k_step(hist, k_rem, k_prefix, prev)
        if k_level < _LEVELS:
            tl.store(
                k_state_ptr + (k_level * 2) * num_rows + rows,
                k_prefix.to(tl.int32, bitcast=True),
                mask=first_slice,
            )
            tl.store(k_state_ptr + (k_level * 2 + 1) * num_rows + rows, k_rem, mask=first_slice)
    if PHASE == 2:  # TOPK, level LEVEL
        if tl.max(k_on.to(tl.int32), 0) > 0:
            count, _ = _digit_histogram(
                row_ptr, mask_row_ptr, row_mask, cols, vocab_size, v_lo, v_hi, temp, z_max,
                sum_z, k_prefix, k_prefix, LEVEL, False, HAS_MASK, 1, BLOCK_V,
            )  # fmt: skip
            digits = tl.arange(0, 16)
            tl.store(k_count_ptr + LEVEL * bpn + mine[:, None] * 16 + digits[None, :], count)
        return
    k_key = tl.where(k_on, k_prefix, 0)

    # The top-p walk's state before digit LEVEL (TOPP), or its result (RACE, FINAL).
    p_prefix = tl.zeros([1], dtype=tl.uint32)
    p_empty = tl.zeros([1], dtype=tl.int1)
    mass_above = tl.zeros([1], dtype=tl.float32)
    p_level = LEVEL if PHASE == 3 else _LEVELS
    if p_level > 0:
        prev = p_level - 1
        count, mass = _merged_histogram(
            p_count_ptr + prev * bpn, p_mass_ptr + prev * bpn, base, slices, s_ok, True
        )
        if prev == 0:
            target = top_p * tl.sum(mass, 1)
            tl.store(target_ptr + rows, target, mask=first_slice)
        else:
            target = tl.load(target_ptr + rows)
            p_prefix = tl.load(p_state_ptr + (prev * 2) * num_rows + rows).to(
                tl.uint32, bitcast=True
            )
            p_empty = tl.load(p_state_ptr + (prev * 2 + 1) * num_rows + rows) != 0
            mass_above = tl.load(p_mass_above_ptr + prev * num_rows + rows)
        p_prefix, mass_above, p_empty = _top_p_step(
            count, mass, mass_above, target, p_empty, p_prefix, prev
        )
        if p_level < _LEVELS:
            tl.store(
                p_state_ptr + (p_level * 2) * num_rows + rows,
                p_prefix.to(tl.int32, bitcast=True),
                mask=first_slice,
            )
            tl.store(
                p_state_ptr + (p_level * 2 + 1) * num_rows + rows,
                p_empty.to(tl.int32),
                mask=first_slice,
            )
            tl.store(p_mass_above_ptr + p_level * num_rows + rows, mass_above, mask=first_slice)
    if PHASE == 3:  # TOPP, level LEVEL
        if tl.max(p_on.to(tl.int32), 0) > 0:
            count, mass = _digit_histogram(
                row_ptr, mask_row_ptr, row_mask, cols, vocab_size, v_lo, v_hi, temp, z_max,
                sum_z, k_key, p_prefix, LEVEL, True, HAS_MASK, 1, BLOCK_V,
            )  # fmt: skip
            digits = tl.arange(0, 16)
            offs = LEVEL * bpn + mine[:, None] * 16 + digits[None, :]
            tl.store(p_count_ptr + offs, count)
            tl.store(p_mass_ptr + offs, mass)
        return
    p_key = tl.where(p_on, p_prefix, 0)
    p_empty = p_on & p_empty

    if PHASE == 4:  # RACE over the slice
        seed = tl.load(seeds_ptr + rows)
        counter_hi = tl.load(steps_ptr + rows) << 32
        min_p_rel = tl.load(min_p_ptr + rows) * (1.0 / sum_z)
        best = tl.full([1], float("-inf"), dtype=tl.float32)
        drawn = tl.zeros([1], dtype=tl.int32)
        for v0 in range(v_lo, v_hi, BLOCK_V):
            x, mask = _load_chunk(row_ptr, mask_row_ptr, row_mask, v0, cols, vocab_size, HAS_MASK)
            race = _race_values(
                x, mask, v0 + cols, temp, z_max, sum_z, k_key, p_key, min_p_rel, p_empty, seed,
                counter_hi,
            )  # fmt: skip
            best, drawn = _running_argmax(best, drawn, race, v0)
        tl.store(race_ptr + mine, best)
        tl.store(race_idx_ptr + mine, drawn)
        return

    # FINAL: the slices' races merged, then the token and its logprob.
    bests = tl.load(race_ptr + base + slices, mask=s_ok, other=float("-inf"))
    idxs = tl.load(race_idx_ptr + base + slices, mask=s_ok, other=0)
    winner = tl.argmax(bests, 1, tie_break_left=True)
    drawn = tl.sum(tl.where(slices == winner[:, None], idxs, 0), 1)
    token = tl.where(invalid, -1, tl.where(temperature > 0.0, drawn, greedy))
    x_tok = tl.load(row_ptr + token, mask=row_mask & ~invalid, other=float("nan"))
    logprob = x_tok - x_ref - tl.log(tl.where(sum_x > 0.0, sum_x, 1.0))
    tl.store(tokens_ptr + rows, token.to(tl.int64))
    tl.store(logprobs_ptr + rows, logprob)


def split_slices(vocab_size: int, slice_len: int = SLICE) -> int:
    """Programs per row: ``ceil(V / slice_len)`` (a function of the vocabulary only)."""
    return triton.cdiv(vocab_size, slice_len)


def sample_split(
    logits: torch.Tensor,
    *,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    token_mask: torch.Tensor | None,
    tokens: torch.Tensor,
    logprobs: torch.Tensor,
    slice_len: int = SLICE,
) -> None:
    """Write ``tokens`` and ``logprobs`` of ``logits [B, V]`` (checked by ``sampling.sample``,
    which calls this when ``V > slice_len``; ``slice_len`` a power of two)."""
    num_rows, vocab_size = logits.shape
    num_slices = split_slices(vocab_size, slice_len)
    device = logits.device

    # Two allocations, carved into the partials and the walks' state, never cleared: every
    # entry a row's result depends on is written before it is read (histograms of a row that
    # does not filter are not, and what they feed is discarded for that row).
    b, n = num_rows, num_slices
    f32 = torch.empty(
        b * n * (4 + LEVELS * 16) + LEVELS * b + b, dtype=torch.float32, device=device
    )
    i32 = torch.empty(
        b * n * (3 + 2 * LEVELS * 16) + 4 * LEVELS * b, dtype=torch.int32, device=device
    )
    f32_views = iter(f32.split([b * n] * 4 + [LEVELS * b * n * 16, LEVELS * b, b]))
    i32_views = iter(i32.split([b * n] * 3 + [LEVELS * b * n * 16] * 2 + [2 * LEVELS * b] * 2))
    part_max, part_sum_x, part_sum_z, race, p_mass, p_mass_above, target = f32_views
    part_arg, part_bad, race_idx, k_count, p_count, k_state, p_state = i32_views
    parts = [part_max, part_arg, part_bad, part_sum_x, part_sum_z]
    args = (
        logits, temperature, top_k, top_p, min_p, seeds, steps, tokens, logprobs,
        token_mask if token_mask is not None else tokens,
        *parts, k_count, p_count, p_mass, k_state, p_state, p_mass_above, target, race,
        race_idx, num_rows, vocab_size, logits.stride(0),
        token_mask.stride(0) if token_mask is not None else 0, num_slices, slice_len,
    )  # fmt: skip
    meta = dict(
        P_POW2=triton.next_power_of_2(num_slices),
        BLOCK_V=min(slice_len, _MAX_BLOCK_V),
        HAS_MASK=token_mask is not None,
        num_warps=_NUM_WARPS,
    )
    grid = (num_rows, num_slices)
    phases = [(MAX, 0), (SUMS, 0)]
    phases += [(TOPK, r) for r in range(LEVELS)] + [(TOPP, r) for r in range(LEVELS)]
    for phase, level in [*phases, (RACE, 0)]:
        _sample_split_kernel[grid](*args, PHASE=phase, LEVEL=level, **meta)
    _sample_split_kernel[(num_rows, 1)](*args, PHASE=FINAL, LEVEL=0, **meta)
