"""Fused sampling: temperature, top-k, top-p, min-p and the draw, without sorting the vocabulary.

Semantics are exactly those of :func:`paged_serve.kernels.reference.sample_ref` (keep rule in
``sampling_keep_mask``): a token is drawable when it passes top-k, top-p (nucleus on the
top-k-renormalised distribution) and min-p on ``p = softmax(logits / temperature)``, and the
draw is the exponential race ``argmax_i p_i / E_i``, ``E_i = -log(u_i)``, over kept tokens.
Temperature-0 rows are argmax of the raw logits (lowest index on ties). The logprob is
``log_softmax(logits)`` (unscaled) at the chosen token. A row holding a NaN or +inf, or no
finite value at all, is invalid: its token is -1 and its logprob NaN, at any temperature.

Algorithm (per row; all passes stream the row in chunks of ``BLOCK_V``)
--------------------------------------------------------------------
1. max and argmax of the raw logits (greedy token); ``max z = max logits / temperature``
   exactly, since division by a positive number is monotone. The same pass counts NaN and
   +inf entries (invalid rows) and keeps NaN out of the max/argmax, whose NaN handling on a
   GPU depends on the reduction tree.
2. ``sum exp(x - max x)`` (for the logprob) and ``sum exp(z - max z)`` (for ``p``).
3. top-k threshold, only if some row in the tile uses top-k: a radix select of the k-th
   largest ``z``. ``z`` is mapped to a uint32 key that sorts like the float (-0.0 folded into
   +0.0); 8 passes each build a 16-bin histogram of the next 4 key bits among the keys that
   match the prefix found so far, and pick the bin holding the k-th largest. The result is the
   exact key of the k-th largest value, so ``z >= kth`` keeps ties as the reference does.
4. top-p threshold, only if some row uses ``top_p < 1``: the same radix walk over the keys of
   ``p`` (non-negative floats, so their bits already sort), restricted to the top-k set, with
   per-bin probability mass next to per-bin counts. It finds the smallest value ``t`` such that
   the mass strictly above ``t`` is ``< top_p * mass(top-k set)``: bin ``d`` holds a kept value
   iff it is non-empty and (mass above the prefix) + (mass of higher bins) < target, and we
   descend into the lowest such bin. Tokens with ``p >= t`` are exactly the reference's
   nucleus (ties included, since "above" is strict). The mass of higher bins is a masked sum,
   exactly 0 for the highest non-empty bin in any order, so the bin chosen at one level always
   holds a qualifying bin at the next: the walk does not depend on exact float sums.
5. min-p: ``p >= min_p * max p`` with ``max p = 1 / sum``.
6. the race over kept tokens with ``u = tl.rand(seed, (step << 32) + token)``: Triton's Philox
   with the row's 64-bit seed as key and counter words (token, step mod 2^32, 0, 0). A seeded
   row therefore draws the same uniforms -- and token -- whatever its row index, batch size
   or neighbours. ``u`` is clamped to the smallest normal float, as in the reference.

Grid: ``(cdiv(B, BLOCK_B),)``. Each program handles ``BLOCK_B`` rows as a ``[BLOCK_B,
BLOCK_V]`` tile (``BLOCK_V`` = vocab rounded up to a power of two, at most 1024; ``BLOCK_B *
BLOCK_V`` = 1024 on CUDA, 65536 under the interpreter, where per-op overhead dominates). Both
depend on the vocabulary size only, never on the batch, so a row's arithmetic (reduction order
included) is batch-independent.
Cost: 3 + (8 if any top-k) + (8 if any top-p) streaming passes over the row, no sort.

The kernel is built from the ``@triton.jit`` helpers of ``sampling_passes.py``, which Triton
inlines (the PTX is that of one long body): every pass loads through ``_load_chunk``; passes 1
and 2 are ``_max_pass`` and ``_sums_pass``; both radix walks histogram with ``_digit_histogram``
(one pass: per-bin counts, and per-bin mass for top-p) and descend one digit per level with
``_top_k_step`` / ``_top_p_step``; the race values of a chunk are ``_race_values``; the greedy
pass and the race fold chunks into a running argmax with ``_running_argmax``. Each pass helper
takes a column range, so the split-row kernel (``sampling_split.py``) runs the same passes over
its slice.

Grammar masks: with a ``token_mask`` (``int32 [B, ceil(V / 32)]``, bit ``t % 32`` of word
``t // 32`` set when token ``t`` is allowed), every pass reads disallowed tokens as -inf
(``_load_chunk``), so the same launch samples constrained and free rows, greedy ones too, from
the constrained distribution. ``HAS_MASK`` is a compile-time switch: a batch without
constrained rows runs a kernel with no mask loads at all.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl
from paged_serve.kernels.triton import sampling_split
from paged_serve.kernels.triton.runtime import check_device, interpreting
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

_MAX_BLOCK_V = 1024
_TILE_CUDA = 1024
_TILE_INTERPRET = 65536


@triton.jit
def _sample_kernel(
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
    num_rows,
    vocab_size,
    stride_row,
    stride_mask_row,
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
    HAS_MASK: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    row_mask = rows < num_rows
    row_ptr = logits_ptr + rows * stride_row
    mask_row_ptr = token_mask_ptr + rows * stride_mask_row
    cols = tl.arange(0, BLOCK_V)

    temperature = tl.load(temperature_ptr + rows, mask=row_mask, other=1.0)
    temp = tl.where(temperature > 0.0, temperature, 1.0)  # greedy rows: keep rule at T=1
    top_k = tl.load(top_k_ptr + rows, mask=row_mask, other=0)
    top_p = tl.load(top_p_ptr + rows, mask=row_mask, other=1.0)
    min_p = tl.load(min_p_ptr + rows, mask=row_mask, other=0.0)
    k_on = row_mask & (top_k > 0) & (top_k < vocab_size)
    p_on = row_mask & (top_p < 1.0)

    # -- pass 1: max and first argmax of the raw logits; rows holding NaN or +inf
    x_max, greedy, num_bad = _max_pass(
        row_ptr, mask_row_ptr, row_mask, cols, vocab_size, 0, vocab_size, HAS_MASK, BLOCK_B,
        BLOCK_V,
    )  # fmt: skip
    invalid = (num_bad > 0) | (x_max == float("-inf"))  # NaN, +inf or nothing finite
    x_ref = tl.where(x_max == float("-inf"), 0.0, x_max)
    z_max = _div(x_ref, temp)

    # -- pass 2: softmax denominators of the raw logits and of z = logits / temperature
    sum_x, sum_z = _sums_pass(
        row_ptr, mask_row_ptr, row_mask, cols, vocab_size, 0, vocab_size, temp, x_ref, z_max,
        HAS_MASK, BLOCK_B, BLOCK_V,
    )  # fmt: skip
    sum_z = tl.where(sum_z > 0.0, sum_z, 1.0)

    # -- passes 3..10: top-k threshold = exact key of the k-th largest z (radix select)
    k_key = tl.zeros([BLOCK_B], dtype=tl.uint32)  # key 0 keeps every token
    if tl.max(k_on.to(tl.int32), 0) > 0:
        prefix = tl.zeros([BLOCK_B], dtype=tl.uint32)
        k_rem = tl.where(k_on, top_k, 1)  # rank still to find among keys matching the prefix
        for r in tl.static_range(8):
            hist, _ = _digit_histogram(
                row_ptr, mask_row_ptr, row_mask, cols, vocab_size, 0, vocab_size, temp, z_max,
                sum_z, k_key, prefix, r, False, HAS_MASK, BLOCK_B, BLOCK_V,
            )  # fmt: skip
            prefix, k_rem = _top_k_step(hist, k_rem, prefix, r)
        k_key = tl.where(k_on, prefix, k_key)

    # -- passes 11..18: top-p threshold = smallest p whose strictly-greater mass < target
    p_key = tl.zeros([BLOCK_B], dtype=tl.uint32)
    p_empty = tl.zeros([BLOCK_B], dtype=tl.int1)  # top_p <= 0 keeps nothing (as the reference)
    if tl.max(p_on.to(tl.int32), 0) > 0:
        prefix = tl.zeros([BLOCK_B], dtype=tl.uint32)
        mass_above = tl.zeros([BLOCK_B], dtype=tl.float32)  # mass of keys above the prefix
        target = tl.zeros([BLOCK_B], dtype=tl.float32)
        for r in tl.static_range(8):
            count, mass = _digit_histogram(
                row_ptr, mask_row_ptr, row_mask, cols, vocab_size, 0, vocab_size, temp, z_max,
                sum_z, k_key, prefix, r, True, HAS_MASK, BLOCK_B, BLOCK_V,
            )  # fmt: skip
            if r == 0:
                target = top_p * tl.sum(mass, 1)
            prefix, mass_above, p_empty = _top_p_step(
                count, mass, mass_above, target, p_empty, prefix, r
            )
        p_key = tl.where(p_on, prefix, p_key)
        p_empty = p_on & p_empty

    # -- final pass: keep mask and exponential race (lowest index wins ties)
    seed = tl.load(seeds_ptr + rows, mask=row_mask, other=0)
    counter_hi = tl.load(steps_ptr + rows, mask=row_mask, other=0) << 32
    min_p_rel = min_p * (1.0 / sum_z)  # min_p * max p
    best = tl.full([BLOCK_B], float("-inf"), dtype=tl.float32)
    drawn = tl.zeros([BLOCK_B], dtype=tl.int32)
    for v0 in range(0, vocab_size, BLOCK_V):
        x, mask = _load_chunk(row_ptr, mask_row_ptr, row_mask, v0, cols, vocab_size, HAS_MASK)
        race = _race_values(
            x, mask, v0 + cols, temp, z_max, sum_z, k_key, p_key, min_p_rel, p_empty, seed,
            counter_hi,
        )  # fmt: skip
        best, drawn = _running_argmax(best, drawn, race, v0)

    token = tl.where(invalid, -1, tl.where(temperature > 0.0, drawn, greedy))
    x_tok = tl.load(row_ptr + token, mask=row_mask & ~invalid, other=float("nan"))
    logprob = x_tok - x_ref - tl.log(tl.where(sum_x > 0.0, sum_x, 1.0))
    tl.store(tokens_ptr + rows, token.to(tl.int64), mask=row_mask)
    tl.store(logprobs_ptr + rows, logprob, mask=row_mask)


@triton.jit
def _uniforms_kernel(seeds_ptr, steps_ptr, out_ptr, vocab_size, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    idx = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    seed = tl.load(seeds_ptr + row)
    counter_hi = tl.load(steps_ptr + row) << 32
    u = tl.rand(seed, counter_hi + idx.to(tl.int64))
    tl.store(out_ptr + row * vocab_size + idx, u, mask=idx < vocab_size)


def _tile_shape(vocab_size: int) -> tuple[int, int]:
    block_v = min(triton.next_power_of_2(vocab_size), _MAX_BLOCK_V)
    tile = _TILE_INTERPRET if interpreting() else _TILE_CUDA
    return max(1, tile // block_v), block_v


def _check_row_param(
    name: str, t: torch.Tensor, dtype: torch.dtype, num_rows: int, device: torch.device
) -> None:
    if t.dtype != dtype or t.shape != (num_rows,):
        raise ValueError(f"{name} must be {dtype} [{num_rows}], got {t.dtype} {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, logits on {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def sample(
    logits: torch.Tensor,
    *,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    token_mask: torch.Tensor | None = None,
    slice_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; returns ``(token_ids [B] int64, logprobs [B] fp32)``.

    Vocabularies larger than ``slice_len`` columns (a power of two; default
    ``sampling_split.SLICE`` on CUDA, no split under the interpreter, whose per-program cost
    would dominate) are split over many programs per row (``kernels/triton/sampling_split.py``),
    smaller ones take one program per row: a function of the vocabulary, not of the batch.

    Rows holding a NaN or +inf, or no finite value, get token -1 and logprob NaN.
    token_mask: optional ``[B, ceil(V / 32)]`` int32 packed bitmask of the allowed tokens
    (grammar-constrained rows; all ones for free rows). Disallowed tokens count as -inf in
    every pass, greedy rows included, and the logprob is then over the allowed tokens. Without
    it the kernel is compiled without the mask loads.

    logits: ``[B, V]`` fp32 (last dim contiguous); temperature, top_p, min_p: ``[B]`` fp32
    (temperature 0 = greedy); top_k: ``[B]`` int32 (``<= 0`` or ``>= V`` disables); seeds,
    steps: ``[B]`` int64 -- the draw's uniforms are keyed by (seed, step, token index).
    """
    # logits: [B, V]
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be fp32 [B, V], got {logits.dtype} {tuple(logits.shape)}")
    num_rows, vocab_size = logits.shape
    if vocab_size == 0:
        raise ValueError("logits must have a non-empty vocabulary")
    if logits.stride(-1) != 1:
        raise ValueError(f"logits' last dim must be contiguous, got strides {logits.stride()}")
    device = logits.device
    check_device(device)
    _check_row_param("temperature", temperature, torch.float32, num_rows, device)
    _check_row_param("top_k", top_k, torch.int32, num_rows, device)
    _check_row_param("top_p", top_p, torch.float32, num_rows, device)
    _check_row_param("min_p", min_p, torch.float32, num_rows, device)
    _check_row_param("seeds", seeds, torch.int64, num_rows, device)
    _check_row_param("steps", steps, torch.int64, num_rows, device)
    words = (vocab_size + 31) // 32
    if token_mask is not None:
        if token_mask.dtype != torch.int32 or tuple(token_mask.shape) != (num_rows, words):
            raise ValueError(
                f"token_mask must be int32 [{num_rows}, {words}], "
                f"got {token_mask.dtype} {tuple(token_mask.shape)}"
            )
        if token_mask.device != device or token_mask.stride(-1) != 1:
            raise ValueError("token_mask must be on the logits' device with a contiguous last dim")

    tokens = torch.empty(num_rows, dtype=torch.int64, device=device)
    logprobs = torch.empty(num_rows, dtype=torch.float32, device=device)
    if num_rows == 0:
        return tokens, logprobs
    if slice_len is None and not interpreting():
        slice_len = sampling_split.SLICE
    if slice_len is not None and vocab_size > slice_len:
        if slice_len < 16 or slice_len & (slice_len - 1):
            raise ValueError(f"slice_len must be a power of two >= 16, got {slice_len}")
        sampling_split.sample_split(
            logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            seeds=seeds, steps=steps, token_mask=token_mask, tokens=tokens, logprobs=logprobs,
            slice_len=slice_len,
        )  # fmt: skip
        return tokens, logprobs
    block_b, block_v = _tile_shape(vocab_size)
    _sample_kernel[(triton.cdiv(num_rows, block_b),)](
        logits,
        temperature,
        top_k,
        top_p,
        min_p,
        seeds,
        steps,
        tokens,
        logprobs,
        token_mask if token_mask is not None else tokens,  # unused without HAS_MASK
        num_rows,
        vocab_size,
        logits.stride(0),
        token_mask.stride(0) if token_mask is not None else 0,
        BLOCK_B=block_b,
        BLOCK_V=block_v,
        HAS_MASK=token_mask is not None,
        num_warps=_NUM_WARPS,
    )
    return tokens, logprobs


def sampling_uniforms(*, seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The uniforms ``[B, V]`` fp32 that :func:`sample` draws for rows (seeds, steps).

    Feeding them to ``reference.sample_ref`` reproduces ``sample`` token for token (up to
    float rounding at exact ties). For tests and for cross-checking a backend.
    """
    if seeds.dtype != torch.int64 or steps.dtype != torch.int64 or seeds.dim() != 1:
        raise ValueError(f"seeds/steps must be int64 [B], got {seeds.dtype}, {steps.dtype}")
    if steps.shape != seeds.shape or steps.device != seeds.device:
        raise ValueError(f"steps {tuple(steps.shape)} must match seeds {tuple(seeds.shape)}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    check_device(seeds.device)
    num_rows = seeds.shape[0]
    out = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=seeds.device)
    if num_rows == 0:
        return out
    block_v = min(triton.next_power_of_2(vocab_size), _MAX_BLOCK_V)
    _uniforms_kernel[(num_rows, triton.cdiv(vocab_size, block_v))](
        seeds.contiguous(), steps.contiguous(), out, vocab_size, BLOCK_V=block_v
    )
    return out
