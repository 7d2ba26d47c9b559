"""The passes both fused samplers stream over a row, as ``@triton.jit`` helpers.

The one-program-per-row kernel (``sampling.py``) runs them over the whole row; the split-row
kernel (``sampling_split.py``) runs the same ones over its program's slice, which is why each
pass helper takes a column range ``v_lo .. v_hi``. Triton inlines them into each kernel:

* ``_load_chunk``: one ``[BLOCK_B, BLOCK_V]`` chunk of logits, grammar-masked tokens read as -inf;
  every pass loads through it.
* ``_max_pass`` / ``_sums_pass``: the max and first argmax of the raw logits (and the count of
  NaN / +inf entries); the softmax denominators of the raw logits and of ``logits / T``.
* ``_digit_histogram``: one radix level (16 bins of 4 key bits), per-bin counts and, for top-p,
  per-bin probability mass; ``_top_k_step`` / ``_top_p_step`` descend one digit per level.
* ``_race_values``: the keep mask and the exponential race of a chunk;
  ``_running_argmax`` folds chunks into a running max and its first column.
* ``_ordered_key``, ``_mass_of_higher_bins``, ``_div``: the float-to-sortable-key map, the
  order-independent mass above each bin, and correctly rounded division.

The algorithm they implement is described in ``sampling.py``'s docstring. ``_NUM_WARPS`` is
the launch setting of both kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl

_NUM_WARPS = 8


@triton.jit
def _ordered_key(x):
    """uint32 key with the same order as the float32 ``x`` (-0.0 and +0.0 map to one key)."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.uint32, bitcast=True)
    sign = tl.full(bits.shape, 0x80000000, tl.uint32)
    # ``bits ^ all_ones`` rather than ``~bits``: Triton 3.6's interpreter evaluates ``~`` on
    # uint32 through a -1 that numpy 2 refuses to cast (compiled code is the same either way).
    all_ones = tl.full(bits.shape, 0xFFFFFFFF, tl.uint32)
    return tl.where((bits & sign) != 0, bits ^ all_ones, bits | sign)


@triton.jit
def _mass_of_higher_bins(mass):
    """``[B, 16]`` bin masses -> ``[B, 16]``: for each bin ``d``, the mass of the bins above it.

    A masked sum, not ``total - cumsum``: the bins above the highest non-empty one contribute
    only zeros, so its result is exactly 0.0 whatever order the reduction adds in. (A GPU scans
    with warp shuffles, so ``total - cum[d]`` is a few ulps off zero there, and a top-p walk
    relying on it can find no qualifying bin, keep nothing and draw token 0.)
    """
    digits = tl.arange(0, 16)
    higher = digits[None, :] > digits[:, None]  # [d, d']: bin d' is above bin d
    return tl.sum(tl.where(higher[None, :, :], mass[:, None, :], 0.0), 2)


@triton.jit
def _div(a, b):
    """``a / b`` rounded to nearest, as torch divides (the reference), for ``z`` and ``p``.

    Triton's ``/`` is PTX ``div.full.f32``, an approximation built on a multiply, and ptxas may
    fuse a multiply with the subtraction that follows it. Then ``z - z_max`` is not 0 at the
    max but the product's rounding error, ~1e22 for a logit of 1e30 at T = 0.9, and ``exp``
    goes to 0 or inf in some passes only. On an H200 such a row kept no token and drew token 0
    (the hazard test's row 11); this is our reading of why. ``div_rn`` gives one correctly
    rounded value in every pass; the interpreter divides with numpy either way.
    """
    return tl.math.div_rn(a, b)


@triton.jit
def _load_chunk(row_ptr, mask_row_ptr, rows_ok, v0, cols, vocab_size, HAS_MASK: tl.constexpr):
    """One ``[BLOCK_B, BLOCK_V]`` chunk of logits from column ``v0``: ``(x, in_vocab)``.

    Columns past the vocabulary and, with ``HAS_MASK``, tokens the row's packed bitmask does not
    allow (bit ``t % 32`` of int32 word ``t // 32``) read as -inf, so every pass sees the
    constrained distribution. Every pass loads through here.
    """
    idx = v0 + cols
    in_vocab = rows_ok[:, None] & (idx < vocab_size)[None, :]
    x = tl.load(row_ptr[:, None] + idx[None, :], mask=in_vocab, other=float("-inf"))
    if HAS_MASK:
        words = tl.load(mask_row_ptr[:, None] + (idx // 32)[None, :], mask=in_vocab, other=0)
        allowed = ((words >> (idx % 32)[None, :]) & 1) != 0
        x = tl.where(allowed, x, float("-inf"))
    return x, in_vocab


@triton.jit
def _running_argmax(best, best_idx, values, v0):
    """Fold a chunk ``values [B, BLOCK_V]`` that starts at column ``v0`` into a running max and
    the first column holding it: ``(best, best_idx)``."""
    c_max = tl.max(values, 1)
    c_arg = tl.argmax(values, 1, tie_break_left=True)
    best_idx = tl.where(c_max > best, v0 + c_arg, best_idx)  # strict: earlier chunk wins ties
    best = tl.maximum(best, c_max)
    return best, best_idx


@triton.jit
def _digit_histogram(
    row_ptr,
    mask_row_ptr,
    rows_ok,
    cols,
    vocab_size,
    v_lo,
    v_hi,
    temp,
    z_max,
    sum_z,
    k_key,
    prefix,
    r: tl.constexpr,
    OF_P: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One radix pass over columns ``v_lo .. v_hi`` of the row (all of it, or a split-row
    program's slice): ``(count, mass)``, both ``[B, 16]``, of digit ``r`` (key bits ``31 - 4r``
    down to ``28 - 4r``) among the keys whose higher digits equal ``prefix``'s.

    Without ``OF_P`` the keys are those of ``z`` over the whole row and ``mass`` stays 0. With
    ``OF_P`` they are those of ``p``, over the top-k set only (``key(z) >= k_key``), and
    ``mass`` sums ``p`` per bin.
    """
    digits = tl.arange(0, 16)
    count = tl.zeros([BLOCK_B, 16], dtype=tl.int32)
    mass = tl.zeros([BLOCK_B, 16], dtype=tl.float32)
    for v0 in range(v_lo, v_hi, BLOCK_V):
        x, mask = _load_chunk(row_ptr, mask_row_ptr, rows_ok, v0, cols, vocab_size, HAS_MASK)
        if OF_P:
            z = _div(x, temp[:, None])
            mask = mask & (_ordered_key(z) >= k_key[:, None])  # nucleus of the top-k set
            p = _div(tl.exp(z - z_max[:, None]), sum_z[:, None])
            key = _ordered_key(p)
        else:
            key = _ordered_key(_div(x, temp[:, None]))
        if r > 0:
            mask = mask & ((key >> (32 - 4 * r)) == (prefix >> (32 - 4 * r))[:, None])
        digit = ((key >> (28 - 4 * r)) & 15).to(tl.int32)
        onehot = (digit[:, :, None] == digits[None, None, :]) & mask[:, :, None]
        count += tl.sum(onehot.to(tl.int32), 1)
        if OF_P:
            mass += tl.sum(tl.where(onehot, p[:, :, None], 0.0), 1)
    return count, mass


@triton.jit
def _top_k_step(hist, k_rem, prefix, r: tl.constexpr):
    """One level of the top-k radix select: ``(prefix, k_rem)`` with digit ``r`` of the prefix
    set to the bin that holds the ``k_rem``-th largest matching key, and that key's rank among
    the keys matching the longer prefix."""
    digits = tl.arange(0, 16)
    # at_or_above[d] = matching keys whose digit is >= d; the k-th largest is in the highest bin
    # where that count reaches k.
    at_or_above = tl.sum(hist, 1)[:, None] - tl.cumsum(hist, 1) + hist
    d_sel = tl.max(tl.where(at_or_above >= k_rem[:, None], digits[None, :], 0), 1)
    k_rem -= tl.sum(tl.where(digits[None, :] > d_sel[:, None], hist, 0), 1)
    return prefix | (d_sel.to(tl.uint32) << (28 - 4 * r)), k_rem


@triton.jit
def _top_p_step(count, mass, mass_above, target, empty, prefix, r: tl.constexpr):
    """One level of the top-p walk: ``(prefix, mass_above, empty)`` with digit ``r`` of the
    prefix set to the lowest bin holding a kept value (non-empty, mass strictly above it
    ``< target``), the mass above that bin's keys, and ``empty`` or'ed with "no bin qualified"
    (the digit is then 15)."""
    digits = tl.arange(0, 16)
    # Mass strictly above the largest key of bin d; exactly mass_above for the highest
    # non-empty bin, so the previous level's choice always qualifies here.
    above = mass_above[:, None] + _mass_of_higher_bins(mass)
    holds_kept = (count > 0) & (above < target[:, None])
    d_sel = tl.min(tl.where(holds_kept, digits[None, :], 16), 1)
    empty = empty | (d_sel == 16)
    d_sel = tl.minimum(d_sel, 15)
    mass_above = tl.sum(tl.where(digits[None, :] == d_sel[:, None], above, 0.0), 1)
    return prefix | (d_sel.to(tl.uint32) << (28 - 4 * r)), mass_above, empty


@triton.jit
def _max_pass(
    row_ptr, mask_row_ptr, rows_ok, cols, vocab_size, v_lo, v_hi, HAS_MASK: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """Over columns ``v_lo .. v_hi``: the max and first argmax of the raw logits, and the
    count of NaN and +inf entries (``[B]`` each)."""
    x_max = tl.full([BLOCK_B], float("-inf"), dtype=tl.float32)
    greedy = tl.zeros([BLOCK_B], dtype=tl.int32)
    num_bad = tl.zeros([BLOCK_B], dtype=tl.int32)
    for v0 in range(v_lo, v_hi, BLOCK_V):
        x, _ = _load_chunk(row_ptr, mask_row_ptr, rows_ok, v0, cols, vocab_size, HAS_MASK)
        num_bad += tl.sum(((x != x) | (x == float("inf"))).to(tl.int32), 1)
        # NaN never reaches the reductions: a GPU's tl.max skips it while tl.argmax keeps it
        # or not depending on the reduction tree (the row's token is -1 anyway).
        x = tl.where(x != x, float("-inf"), x)
        x_max, greedy = _running_argmax(x_max, greedy, x, v0)
    return x_max, greedy, num_bad


@triton.jit
def _sums_pass(
    row_ptr, mask_row_ptr, rows_ok, cols, vocab_size, v_lo, v_hi, temp, x_ref, z_max,
    HAS_MASK: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """Over columns ``v_lo .. v_hi``: the softmax denominators of the raw logits (about
    ``x_ref``) and of ``z = logits / temp`` (about ``z_max``), ``[B]`` each."""
    sum_x = tl.zeros([BLOCK_B], dtype=tl.float32)
    sum_z = tl.zeros([BLOCK_B], dtype=tl.float32)
    for v0 in range(v_lo, v_hi, BLOCK_V):
        x, _ = _load_chunk(row_ptr, mask_row_ptr, rows_ok, v0, cols, vocab_size, HAS_MASK)
        sum_x += tl.sum(tl.exp(x - x_ref[:, None]), 1)
        sum_z += tl.sum(tl.exp(_div(x, temp[:, None]) - z_max[:, None]), 1)
    return sum_x, sum_z


@triton.jit
def _race_values(
    x, in_vocab, idx, temp, z_max, sum_z, k_key, p_key, min_p_rel, p_empty, seed, counter_hi
):  # fmt: skip
    """The exponential race of a chunk ``x [B, BLOCK_V]`` at columns ``idx``: ``p / E`` where
    the token is kept (top-k, top-p, min-p), -1 where it is not, -inf outside the vocabulary;
    ``E = -log(u)`` with ``u`` the row's Philox uniform for (seed, step, token)."""
    z = _div(x, temp[:, None])
    p = _div(tl.exp(z - z_max[:, None]), sum_z[:, None])
    keep = (_ordered_key(z) >= k_key[:, None]) & (_ordered_key(p) >= p_key[:, None])
    keep = keep & (p >= min_p_rel[:, None]) & ~p_empty[:, None]
    u = tl.rand(seed[:, None], counter_hi[:, None] + idx[None, :].to(tl.int64))
    race = p / -tl.log(tl.maximum(u, 1.1754943508222875e-38))
    return tl.where(in_vocab, tl.where(keep, race, -1.0), float("-inf"))
