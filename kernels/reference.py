"""Eager PyTorch references for every kernel family (fp32 math).

These are the ground truth the Triton kernels and the CPU platform's attention
(``engine/platform/cpu/attention_plan.py``) are tested and benchmarked against. The engine's
`torch` backend (the CPU default) also runs the KV write, block copy and sampling references
directly, so those are vectorised rather than written as per-token loops; the attention
reference goes one sequence at a time, for clarity.

Shared conventions (the kernels follow them exactly):

* KV cache: one tensor per layer and side, ``[num_blocks, block_size, num_kv_heads, head_dim]``.
  Token ``t`` of a sequence lives in block ``block_tables[s, t // block_size]`` at offset
  ``t % block_size``; its flat *slot* is ``block * block_size + offset``.
* Quantized KV cache: the same layout holding int8 / fp8 codes, beside fp32 scales
  ``[num_blocks, block_size, num_kv_heads]``, one per token and KV head; a cached value is
  ``code * scale`` (:func:`quantize_kv_ref`, :func:`dequantize_kv_ref`).
* Ragged queries: the step's query tokens are concatenated, sequence by sequence;
  ``cu_seqlens_q [S + 1]`` gives each sequence's slice. ``seq_lens [S]`` is each sequence's
  context length *including* the new tokens, so the ``i``-th of ``q_len`` new tokens sits at
  position ``seq_len - q_len + i`` and attends to every key at a position ``<=`` its own
  (causal inside the chunk, full over the cached prefix); with ``causal=False`` (encoders) to
  every key of its sequence, positions ``[0, seq_len)``.
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

from collections.abc import Callable

import torch

from paged_serve.kernels.interface import ExpertWeights, IntExperts


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
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    causal: bool = True,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    attention_chunk: int | None = None,
) -> torch.Tensor:
    """Attention of ragged query chunks over the paged KV cache, in fp32, one sequence at a time.

    q: ``[T, Hq, D]``; k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``;
    block_tables: ``[S, max_blocks]`` int32; seq_lens: ``[S]`` int32 (context incl. new tokens);
    cu_seqlens_q: ``[S + 1]`` int32. The query at position ``q`` sees the keys ``k <= q`` of its
    sequence; ``sliding_window`` w (if set) limits it to the ``w`` most recent of them
    (``k > q - w``, its own included), as HF's Mistral does. ``causal=False`` (bidirectional
    encoders): it sees every key ``k`` in ``[0, seq_len)``, and with a window those with
    ``|k - q| < w`` (ModernBERT's local attention, ``w = local_attention // 2 + 1``).
    ``attention_chunk`` C (causal only; Llama 4's chunked layers) also hides the keys before
    the query's chunk: ``k >= q // C * C``.
    ``max_seqlen_q`` / ``max_seqlen_k`` are accepted for interface parity with the kernel.
    ``softcap`` c replaces each scaled score ``s`` by ``c * tanh(s / c)`` before masking (Gemma
    2); ``sinks [Hq]`` adds ``exp(sink_h)`` to each row's softmax denominator, a logit that
    attends to nothing (gpt-oss's ``s_aux``). ``k_scale``, ``v_scale`` ``[num_blocks, block_size,
    Hkv]`` fp32 (both or neither): the caches hold int8/fp8 codes, and each gathered block is
    dequantized (:func:`dequantize_kv_ref`) before the same math.
    Returns ``[T, Hq, D]`` in ``q.dtype``. Written for clarity, not speed: the CPU platform's
    production attention is ``engine/platform/cpu/attention_plan.py``.
    """
    _check_kv_scales(k_scale, v_scale)
    check_attention_chunk(attention_chunk, causal)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        first, last = cu[s], cu[s + 1]
        if last == first:
            continue
        blocks = block_tables[s, : (seq_len + block_size - 1) // block_size].long()
        k_blocks, v_blocks = k_cache[blocks], v_cache[blocks]  # [n, block_size, Hkv, D]
        if k_scale is not None:
            k_blocks = dequantize_kv_ref(k_blocks, k_scale[blocks])
            v_blocks = dequantize_kv_ref(v_blocks, v_scale[blocks])
        # [L, Hkv, D] -> [Hq, L, D]: query head h reads KV head h // group
        k = k_blocks.flatten(0, 1)[:seq_len].float().repeat_interleave(group, 1)
        v = v_blocks.flatten(0, 1)[:seq_len].float().repeat_interleave(group, 1)
        queries = q[first:last].float().transpose(0, 1)  # [Hq, Lq, D]
        scores = queries @ k.permute(1, 2, 0) * scale  # [Hq, Lq, L]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - (last - first), seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        allowed = _allowed_keys(q_pos, k_pos, sliding_window, causal, attention_chunk)
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:  # one more column per head, dropped after the softmax
            sink = sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
            probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[first:last] = (probs @ v.transpose(0, 1)).transpose(0, 1)
    return out.to(q.dtype)


def check_attention_chunk(attention_chunk: int | None, causal: bool) -> None:
    """ValueError unless ``attention_chunk`` is None or a positive number of tokens of a causal
    layer (a chunk bounds a query's keys from below; encoders have no chunked layers)."""
    if attention_chunk is None:
        return
    if attention_chunk < 1:
        raise ValueError(f"attention_chunk must be >= 1 or None, got {attention_chunk}")
    if not causal:
        raise ValueError("attention_chunk applies to causal attention only")


def _allowed_keys(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    sliding_window: int | None,
    causal: bool,
    attention_chunk: int | None = None,
) -> torch.Tensor:
    """``[Lq, L]`` bool: which key positions ``k_pos [1, L]`` each query position ``q_pos
    [Lq, 1]`` sees (``paged_attention_ref``'s rule)."""
    if causal:
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        if attention_chunk is not None:
            allowed &= k_pos >= q_pos // attention_chunk * attention_chunk
        return allowed
    if sliding_window is None:
        return torch.ones(q_pos.shape[0], k_pos.shape[1], dtype=torch.bool, device=q_pos.device)
    return (k_pos - q_pos).abs() < sliding_window


def mla_attention_ref(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    *,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    latent_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Multi-head latent attention with absorbed weights, in fp32 (float64 for a float64 q),
    one sequence at a time.

    latent_cache: ``[num_blocks, block_size, R + rope]``, one entry per token: the normalised
    latent (first ``R = kv_lora_rank`` lanes) and the rotated shared key part. q: ``[T, H, R +
    rope]``, each head's ``q_nope @ W_UK`` then its rotated ``q_rope``. Head ``h`` scores a
    token ``q_h . entry * scale`` over every lane and takes the latent ``entry[:R]`` as its
    value, causal inside a chunk as in :func:`paged_attention_ref` (same metadata; the maxima
    are accepted for interface parity). ``latent_scale [num_blocks, block_size]`` fp32: the
    cache holds int8/fp8 codes, and each gathered entry is dequantized (``code * scale``,
    :func:`dequantize_kv_ref`) before the same math. Returns ``[T, H, R]`` in ``q.dtype``: the
    latent outputs, which ``W_UV`` turns into per-head values.
    """
    block_size = latent_cache.shape[1]
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros((*q.shape[:2], kv_lora_rank), dtype=compute, device=q.device)
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        first, last = cu[s], cu[s + 1]
        if last == first:
            continue
        blocks = block_tables[s, : (seq_len + block_size - 1) // block_size].long()
        entries = latent_cache[blocks]  # [n, block_size, R + rope]
        if latent_scale is not None:
            entries = dequantize_kv_ref(entries, latent_scale[blocks])
        entries = entries.flatten(0, 1)[:seq_len].to(compute)  # [L, R + rope]
        queries = q[first:last].to(compute).transpose(0, 1)  # [H, Lq, R + rope]
        scores = queries @ entries.T * scale  # [H, Lq, L]
        q_pos = torch.arange(seq_len - (last - first), seq_len, device=q.device)[:, None]
        allowed = torch.arange(seq_len, device=q.device)[None, :] <= q_pos
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        out[first:last] = (probs @ entries[:, :kv_lora_rank]).transpose(0, 1)
    return out.to(q.dtype)


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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Scatter ``key``/``value`` ``[T, Hkv, D]`` into the caches at ``slot_mapping [T]`` (int64).

    Slot ``-1`` means "do not write". In place, exact. With ``k_scale``, ``v_scale``
    ``[num_blocks, block_size, Hkv]`` fp32 (both or neither) the caches hold int8/fp8 codes:
    each token's heads are quantized (:func:`quantize_kv_ref`, to the caches' dtype) and the
    codes and scales scattered; a slot of -1 gets neither.
    """
    _check_kv_scales(k_scale, v_scale)
    slots, rows = kept_slots(slot_mapping)
    if k_scale is None:
        scatter_kv(key, value, k_cache, v_cache, slots, rows)
        return
    if rows is not None:
        key, value = key[rows], value[rows]
    k_codes, k_scales = quantize_kv_ref(key, dtype=k_cache.dtype)
    v_codes, v_scales = quantize_kv_ref(value, dtype=v_cache.dtype)
    scatter_kv(k_codes, v_codes, k_cache, v_cache, slots, None)
    num_slots = k_scale.shape[0] * k_scale.shape[1]
    k_scale.view(num_slots, k_scale.shape[2])[slots] = k_scales
    v_scale.view(num_slots, v_scale.shape[2])[slots] = v_scales


# ------------------------------------------------------------------------ quantized KV cache
# int8 / fp8 codes ``[num_blocks, block_size, Hkv, D]`` beside fp32 scales ``[num_blocks,
# block_size, Hkv]``: one scale per token and KV head (vLLM's int8_per_token_head /
# fp8_per_token_head). A cached value is ``code * scale``.

KV_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def quantize_kv_ref(x: torch.Tensor, *, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [T, H, D] dtype, scale [T, H] fp32)`` of ``x [T, H, D]``, per token and head,
    in fp32: ``scale = amax / QMAX`` (``KV_QMAX``; 1.0 where ``amax == 0``, whose codes are all
    zero) with ``amax = max |x|`` over the D lanes; int8 codes ``round(x / scale)`` to nearest,
    ties to even, within ``[-127, 127]``; fp8 codes ``x / scale`` clamped to ``[-QMAX, QMAX]``
    and cast (round to nearest even)."""
    if dtype not in KV_QMAX:
        raise ValueError(f"KV codes must be one of {tuple(KV_QMAX)}, got {dtype}")
    qmax = KV_QMAX[dtype]
    x = x.float()
    amax = x.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    y = (x / scale[..., None]).clamp(-qmax, qmax)
    codes = torch.round(y) if dtype == torch.int8 else y
    return codes.to(dtype), scale


def dequantize_kv_ref(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``codes.float() * scale`` (fp32): codes ``[..., H, D]``, scale ``[..., H]``."""
    return codes.float() * scale.float()[..., None]


def _check_kv_scales(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    if (k_scale is None) != (v_scale is None):
        raise ValueError("k_scale and v_scale go together: pass both (quantized cache) or neither")


def write_latent_ref(
    latent: torch.Tensor,
    latent_cache: torch.Tensor,
    *,
    slot_mapping: torch.Tensor,
    latent_scale: torch.Tensor | None = None,
) -> None:
    """Scatter ``latent [T, C]`` into ``latent_cache [num_blocks, block_size, C]`` at
    ``slot_mapping [T]`` (int64; ``-1``: do not write). In place, exact. With ``latent_scale
    [num_blocks, block_size]`` fp32 the cache holds int8/fp8 codes: each entry is quantized as
    one head (:func:`quantize_kv_ref`, one scale per token, to the cache's dtype) and its codes
    and scale scattered; a slot of -1 gets neither."""
    slots, rows = kept_slots(slot_mapping)
    if rows is not None:
        latent = latent[rows]
    num_blocks, block_size, width = latent_cache.shape
    if latent_scale is not None:
        codes, scales = quantize_kv_ref(latent[:, None], dtype=latent_cache.dtype)
        latent_scale.view(num_blocks * block_size)[slots] = scales[:, 0]
        latent = codes[:, 0]
    latent_cache.view(num_blocks * block_size, width)[slots] = latent.to(latent_cache.dtype)


def copy_blocks_ref(kv_caches: torch.Tensor, *, block_mapping: torch.Tensor) -> None:
    """Copy whole blocks for every layer and side at once.

    kv_caches: ``[num_layers, sides, num_blocks, block_size, Hkv, D]`` (the engine's one
    allocation: 2 sides, K and V, or 1, a latent cache's entries); block_mapping: ``[N, 2]``
    int64 rows of ``(src_block, dst_block)``. In place, exact. Destinations must be distinct
    and never also a source in the same call. Any dtype, int8 and fp8 codes included; a
    quantized cache's scales ``[num_layers, 2, num_blocks, block_size, Hkv]`` are copied by a
    second call on their ``[..., Hkv, 1]`` view.
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
    49,152 on the 2-core CPU (docs/measurements/cpu-kernels.md). A row holding NaN gets some index:
    callers mark those rows invalid (``invalid_rows``)."""
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


def fused_moe_ref(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    apply_gate: Callable[[torch.Tensor], torch.Tensor],
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mixture of experts, pair by pair, in fp32: token ``t`` gets
    ``sum_j w_tj * (gate(x_t @ W1[e]^T + b1[e]) @ W2[e]^T + b2[e])`` with ``e = topk_ids[t, j]``.

    hidden: ``[T, H]``; w_gate_up: ``[E, 2I, H]``; w_down: ``[E, H, I]``; topk_ids,
    topk_weights: ``[T, k]``; biases ``[E, 2I]`` and ``[E, H]``; ``apply_gate``: the model's
    gate, ``[..., 2I] -> [..., I]``. Returns ``[T, H]`` in hidden's dtype.
    """
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    x = hidden.float()
    for t in range(hidden.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            h = w_gate_up[e].float() @ x[t]
            if gate_up_bias is not None:
                h = h + gate_up_bias[e].float()
            y = w_down[e].float() @ apply_gate(h[None])[0].float()
            if down_bias is not None:
                y = y + down_bias[e].float()
            out[t] += topk_weights[t, j].float() * y
    return out.to(hidden.dtype)


# --------------------------------------------------------------------------- linear attention
# Gated DeltaNet layers (Qwen3-Next, Qwen3.5) keep a fixed-size state per sequence instead of a
# growing KV cache: a convolution window ``conv_state [num_slots, K - 1, C]`` (the last K - 1
# inputs of a depthwise causal convolution of width K) and a recurrent state
# ``state [num_slots, Hv, Dk, Dv]``. A step's ragged sequences (``cu_seqlens [S + 1]``) read and
# update slot ``state_slots[s]``; ``has_state[s] == 0`` starts the sequence from zeros (its first
# chunk), whatever the slot held.


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    state_slots: torch.Tensor,
    has_state: torch.Tensor,
    silu: bool = True,
) -> torch.Tensor:
    """Depthwise causal convolution of each sequence's ``x [T, C]`` rows, continuing from its
    window: ``out[t, c] = act(bias[c] + sum_j weight[c, j] * ext[t + j, c])`` with ``ext`` the
    window (``K - 1`` rows, zeros for a fresh sequence) followed by the sequence's rows. The
    window becomes ``ext``'s last ``K - 1`` rows (in place). Computed in fp32 (in float64 for
    float64 inputs); ``[T, C]`` in ``x``'s dtype."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    out = torch.empty_like(x)
    w = weight.to(compute)
    b_c = None if bias is None else bias.to(compute)
    for s, (a, b) in enumerate(zip(cu_seqlens.tolist(), cu_seqlens[1:].tolist())):
        slot = int(state_slots[s])
        prev = conv_state[slot].to(compute)
        if not int(has_state[s]):
            prev = torch.zeros_like(prev)
        y, window = causal_conv_rows(prev, x[a:b].to(compute), w, b_c, silu)
        out[a:b] = y.to(x.dtype)
        conv_state[slot] = window.to(conv_state.dtype)
    return out


def causal_conv_rows(
    window: torch.Tensor,
    rows: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's convolution: ``window [K - 1, C]`` then ``rows [n, C]`` with ``weight
    [C, K]`` and ``bias [C]`` (all in the compute dtype); ``(outputs [n, C], the new window
    [K - 1, C])``, the window being the last ``K - 1`` of window and rows."""
    n = rows.shape[0]
    ext = torch.cat([window, rows])  # [K - 1 + n, C]
    y = sum(ext[j : j + n] * weight[:, j] for j in range(weight.shape[1]))
    if bias is not None:
        y = y + bias
    if silu:
        y = torch.nn.functional.silu(y)
    return y, ext[n:]


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` over the last dim (the gated delta rule's q/k norm)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    state_slots: torch.Tensor,
    has_state: torch.Tensor,
    max_seqlen_q: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """The gated delta rule, token by token (its definition).

    q, k ``[T, Hk, Dk]``; v ``[T, Hv, Dv]``; g (log decay, <= 0) and beta ``[T, Hv]``; value
    head ``h`` reads key head ``h // (Hv // Hk)``. q and k are L2-normalised, q scaled by
    ``scale`` (``Dk ** -0.5``). For each token, per head, with ``S [Dk, Dv]``::

        S = exp(g) * S;  S += k (beta * (v - k^T S));  o = q^T S

    Computed in ``state``'s dtype (fp32; float64 to check); the final ``S`` goes back to the
    slot. Returns ``o [T, Hv, Dv]`` in v's dtype. ``max_seqlen_q`` is the kernels' launch choice
    (unused here)."""
    del max_seqlen_q
    compute = state.dtype
    num_v, num_k = v.shape[1], k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = num_v // num_k
    qn = l2_normalize(q.to(compute)).repeat_interleave(group, dim=1) * scale
    kn = l2_normalize(k.to(compute)).repeat_interleave(group, dim=1)
    vv, gg, bb = v.to(compute), g.to(compute), beta.to(compute)
    out = torch.empty(v.shape, dtype=compute, device=v.device)
    for s, (a, b) in enumerate(zip(cu_seqlens.tolist(), cu_seqlens[1:].tolist())):
        slot = int(state_slots[s])
        S = state[slot].clone() if int(has_state[s]) else torch.zeros_like(state[slot])
        for t in range(a, b):
            S = S * gg[t].exp()[:, None, None]
            delta = (vv[t] - torch.einsum("hkv,hk->hv", S, kn[t])) * bb[t][:, None]
            S = S + kn[t][:, :, None] * delta[:, None, :]
            out[t] = torch.einsum("hkv,hk->hv", S, qn[t])
        state[slot] = S
    return out.to(v.dtype)


def ssd_scan_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    state: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    state_slots: torch.Tensor,
    has_state: torch.Tensor,
    max_seqlen_q: int | None = None,
) -> torch.Tensor:
    """Mamba-2's selective state-space recurrence, token by token (its definition).

    x ``[T, H, P]``; dt ``[T, H]`` (the step size, softplus and limits already applied); A
    ``[H]`` (negative); B and C ``[T, G, N]``, head ``h`` reading group ``h // (H // G)``; D
    ``[H]`` (the skip) or None. For each token, per head, with ``S [P, N]``::

        S = exp(dt * A) * S + dt * x B^T;  y = S C + D * x

    Computed in ``state``'s dtype (fp32; float64 to check); the final ``S`` goes back to the
    slot (``state [slots, H, P, N]``), a sequence with ``has_state == 0`` starting from zeros.
    Returns ``y [T, H, P]`` in x's dtype. ``max_seqlen_q`` is the kernels' launch choice
    (unused here)."""
    del max_seqlen_q
    compute = state.dtype
    group = x.shape[1] // B.shape[1]
    xx, dd = x.to(compute), dt.to(compute)
    bb = B.to(compute).repeat_interleave(group, dim=1)  # [T, H, N]
    cc = C.to(compute).repeat_interleave(group, dim=1)
    decay = (dd * A.to(compute)).exp()  # [T, H]
    out = torch.empty(x.shape, dtype=compute, device=x.device)
    for s, (a, b) in enumerate(zip(cu_seqlens.tolist(), cu_seqlens[1:].tolist())):
        slot = int(state_slots[s])
        S = state[slot].clone() if int(has_state[s]) else torch.zeros_like(state[slot])
        for t in range(a, b):
            S = S * decay[t][:, None, None]
            S = S + (dd[t][:, None] * xx[t])[:, :, None] * bb[t][:, None, :]
            out[t] = torch.einsum("hpn,hn->hp", S, cc[t])
        state[slot] = S
    if D is not None:
        out = out + D.to(compute)[:, None] * xx
    return out.to(x.dtype)


# --------------------------------------------------------------------- weight-only quantization
# One canonical layout for W4A16 / W8A16 weights (GPTQ, AWQ and compressed-tensors' packed
# checkpoints are repacked into it at load): ``qweight [K // pack, N]`` int32 with
# ``pack = 32 // bits`` values per word packed along K, lowest bits first; ``scales
# [num_groups, N]``; ``zeros [num_groups, N]`` unpacked integers (None: symmetric, zero
# ``2 ** (bits - 1)``); group ``g = k // group_size`` (``group_size == -1``: one group).


def pack_int_ref(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``values [K, N]`` (integers in ``[0, 2**bits)``) along K: ``[K // pack, N]`` int32.

    Word ``r`` holds rows ``r * pack + i`` at bits ``i * bits`` (low bits first); a word whose
    top bit is set is stored as the negative int32 of the same bits.
    """
    pack = 32 // bits
    k, n = values.shape
    if k % pack:
        raise ValueError(f"K={k} is not a multiple of the {pack} values per int32 word")
    v = values.to(torch.int64)
    if bool((v < 0).any()) or bool((v >= 1 << bits).any()):
        raise ValueError(f"values must lie in [0, {1 << bits}) for {bits}-bit packing")
    shifts = torch.arange(pack, dtype=torch.int64, device=v.device) * bits
    words = (v.view(k // pack, pack, n) << shifts[None, :, None]).sum(dim=1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def unpack_int_ref(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """The ``[K, N]`` int32 values of ``qweight [K // pack, N]``: :func:`pack_int_ref` undone."""
    pack = 32 // bits
    rows, n = qweight.shape
    shifts = torch.arange(pack, dtype=torch.int64, device=qweight.device) * bits
    values = (qweight.to(torch.int64)[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
    return values.reshape(rows * pack, n).to(torch.int32)


def dequantize_ref(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    *,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    """The ``[N, K]`` fp32 weight: ``w[n, k] = (q[k, n] - zero[g, n]) * scale[g, n]``,
    ``g = k // group_size`` (``group_size == -1``: one group over K; ``zeros`` None: the zero
    is ``2 ** (bits - 1)``)."""
    q = unpack_int_ref(qweight, bits)
    k = q.shape[0]
    group = torch.arange(k, device=q.device) // (k if group_size == -1 else group_size)
    if zeros is None:
        zero = torch.full_like(q, 1 << (bits - 1))
    else:
        zero = zeros.to(torch.int32)[group]
    return ((q - zero).float() * scales.float()[group]).t()


def quantized_gemm_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    *,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [M, K] @ dequant(W)^T (+ bias [N])`` in fp32: ``[M, N]`` in x's dtype (the layout
    and the dequantization are :func:`dequantize_ref`'s)."""
    w = dequantize_ref(qweight, scales, zeros, bits=bits, group_size=group_size)
    out = x.float() @ w.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


# ---------------------------------------------------------------------------- W8A8: FP8 and int8
# Checkpoint weights stored in 8 bits (``[N, K]`` e4m3 with a tensor, channel or ``bn x bk``
# block scale; int8 with a channel scale) multiply activations quantized at run time: per row,
# or per row and group of ``bk`` inputs with block scales, ``scale = max(amax, 1e-10) / QMAX``
# (448 for e4m3, 127 for int8), ``code = round(clamp(x / scale, -QMAX, QMAX))`` to nearest, ties
# to even (torch's fp8 cast and ``torch.round``). Then fp32: dequantized codes @ dequantized W^T.

FP8_MAX = 448.0
INT8_MAX = 127.0
AMAX_FLOOR = 1e-10


def _group_scales(x: torch.Tensor, group_size: int, qmax: float) -> torch.Tensor:
    """``[M, ceil(K / group_size)]`` fp32: each group's ``max(amax, AMAX_FLOOR) / qmax``."""
    m, k = x.shape
    num_groups = -(-k // group_size)
    padded = torch.zeros(m, num_groups * group_size, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.abs()
    amax = padded.view(m, num_groups, group_size).amax(dim=-1)
    return amax.clamp_min(AMAX_FLOOR) / qmax


def _per_input(scales: torch.Tensor, group_size: int, k: int) -> torch.Tensor:
    """``[M, K]``: each input's group scale."""
    return scales.repeat_interleave(group_size, dim=1)[:, :k]


def quantize_fp8_rows_ref(
    rows: torch.Tensor, *, group_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [M, K] float8_e4m3fn, scales [M, ceil(K / group)] fp32)`` of ``rows [M, K]``;
    a group is ``group_size`` inputs of a row, or the row (None)."""
    x = rows.float()
    group = x.shape[1] if group_size is None else group_size
    scales = _group_scales(x, group, FP8_MAX)
    y = (x / _per_input(scales, group, x.shape[1])).clamp(-FP8_MAX, FP8_MAX)
    return y.to(torch.float8_e4m3fn), scales


def quantize_int8_rows_ref(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [M, K] int8, scales [M, 1] fp32)``: one scale per row, ties to even."""
    x = rows.float()
    scales = _group_scales(x, x.shape[1], INT8_MAX)
    y = (x / scales).clamp(-INT8_MAX, INT8_MAX)
    return torch.round(y).to(torch.int8), scales


def dequantize_fp8_ref(
    weight: torch.Tensor, scale: torch.Tensor, *, block_size: tuple[int, int] | None
) -> torch.Tensor:
    """``[N, K]`` fp32 of an e4m3 ``weight [N, K]``: ``weight * scale`` with ``scale`` ``[]`` or
    ``[1]`` (tensor), ``[N]`` (channel), or ``[ceil(N / bn), ceil(K / bk)]`` (block)."""
    w = weight.float()
    if block_size is None:
        s = scale.float()
        return w * (s[:, None] if s.dim() == 1 and s.numel() > 1 else s.reshape(()))
    bn, bk = block_size
    n, k = w.shape
    per_element = scale.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)
    return w * per_element[:n, :k]


def _w8a8_product(
    a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    out = a @ w.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(dtype)


def fp8_gemm_ref(
    rows: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    *,
    block_size: tuple[int, int] | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[M, N]`` in rows' dtype: the e4m3-quantized ``rows [M, K]`` (per row and ``bk`` inputs
    with ``block_size = (bn, bk)``, else per row), dequantized, ``@`` the dequantized weight
    ``[N, K]``'s transpose (:func:`dequantize_fp8_ref`), plus ``bias [N]``, in fp32."""
    k = rows.shape[1]
    group = None if block_size is None else block_size[1]
    codes, scales = quantize_fp8_rows_ref(rows, group_size=group)
    a = codes.float() * _per_input(scales, k if group is None else group, k)
    w = dequantize_fp8_ref(weight, scale, block_size=block_size)
    return _w8a8_product(a, w, bias, rows.dtype)


def int8_gemm_ref(
    rows: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[M, N]`` in rows' dtype: the int8-quantized ``rows [M, K]`` (per row), dequantized,
    ``@ (weight [N, K] * scale [N, None])^T`` plus ``bias [N]``, in fp32."""
    codes, scales = quantize_int8_rows_ref(rows)
    w = weight.float() * scale.float()[:, None]
    return _w8a8_product(codes.float() * scales, w, bias, rows.dtype)


def dequantize_experts_ref(weights: ExpertWeights) -> torch.Tensor:
    """The ``[E, N, K]`` fp32 weights of quantized experts (``kernels/interface.py``'s
    ``IntExperts``: :func:`dequantize_ref` expert by expert; ``Fp8Experts``: each e4m3 value
    times its block's or its row's scale). ``fused_moe_ref`` over these is the quantized fused
    MoE's reference."""
    if isinstance(weights, IntExperts):
        zeros = weights.zeros
        return torch.stack(
            [
                dequantize_ref(
                    weights.qweight[e],
                    weights.scales[e],
                    None if zeros is None else zeros[e],
                    bits=weights.bits,
                    group_size=weights.group_size,
                )
                for e in range(weights.qweight.shape[0])
            ]
        )
    return torch.stack(
        [
            dequantize_fp8_ref(w, scale, block_size=weights.block)
            for w, scale in zip(weights.weight, weights.scale)
        ]
    )


# ---------------------------------------------------------------------------- batched multi-LoRA
# Each token carries the slot of its adapter (-1: none); a slot holds one adapter's A [R, K] and
# B [R, N] (its scaling folded into B). Shrink: s[t] = A[slot_t] @ x[t]; expand: y[t] +=
# s[t] @ B[slot_t]. Both in fp32; a token without an adapter gets a zero s row and keeps its y.


def _tokens_by_slot(token_slots: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """``(slot, token indices)`` for every slot some token uses, slot -1 left out."""
    used = torch.unique(token_slots[token_slots >= 0])
    return [(int(slot), torch.nonzero(token_slots == slot).flatten()) for slot in used]


def lora_shrink_ref(
    x: torch.Tensor,
    a: torch.Tensor,
    token_slots: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``s [T, R]`` fp32: ``s[t] = a[slot_t] @ x[t]`` in fp32, zeros where ``slot_t == -1``.

    x: ``[T, K]``; a: ``[S, R, K]``; token_slots: ``[T]`` int32; out: ``[T, R]`` fp32 to write
    into (else allocated). One matmul per slot over the tokens using it.
    """
    s = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for slot, rows in _tokens_by_slot(token_slots):
        s[rows] = x[rows].float() @ a[slot].float().t()
    if out is None:
        return s
    out.copy_(s)
    return out


def lora_expand_ref(
    s: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, y: torch.Tensor
) -> None:
    """In place: ``y[t] += s[t] @ b[slot_t]``, the product and the sum in fp32, stored in y's
    dtype; rows where ``slot_t == -1`` untouched.

    s: ``[T, R]`` fp32; b: ``[S, R, N]``; token_slots: ``[T]`` int32; y: ``[T, N]``. One matmul
    per slot over the tokens using it.
    """
    for slot, rows in _tokens_by_slot(token_slots):
        y[rows] = (y[rows].float() + s[rows].float() @ b[slot].float()).to(y.dtype)
