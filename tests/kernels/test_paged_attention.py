"""Paged attention kernel vs ``reference.paged_attention_ref``.

Every batch is built by ``build_paged_batch`` (conftest): shuffled block tables, and NaN in every
cache slot that does not hold a live token (block tails, spare blocks, unused table entries), so
each case also checks that free slots never reach the result.

Under the interpreter (CPU) the cases below are a covering subset -- every value of every axis
appears at least once: batch sizes 1/3/7; (Hq, Hkv) (4,4), (8,2), (9,3), (16,2); head dims
64/80/128; block sizes 16/32; contexts 1, bs-1, bs, bs+1 and ragged; decode-only, prefill-only
and mixed batches; split-KV off, explicit and automatic; sliding window; fp32 and fp16. The
non-causal (encoder) cases add head dims 96 and bf16. The cartesian grid (plus 32/8 heads, head
dims 96/256, contexts to 8k, bf16) runs on CUDA only.
"""

from __future__ import annotations

import inspect
import itertools
import math

import pytest
import torch

from paged_serve.kernels.reference import paged_attention_ref
from paged_serve.kernels.triton.attention_checks import AttentionShapes
from paged_serve.kernels.triton.paged_attention import (
    _paged_attention_kernel,
    attention_launch,
    choose_num_kv_splits,
    paged_attention,
    workspace_numel,
)

# (dtype, atol, rtol) for kernel output vs the fp32 reference run on the same (rounded) inputs.
# fp32: both sides are fp32; only summation order, the online-softmax rescaling and exp2 vs exp
#   differ, each ~1 ulp (1.2e-7) of O(1) values; 1e-5 leaves ~100x headroom and still catches
#   TF32 dots (~1e-3 error).
# fp16: the softmax weights are rounded to fp16 before the P.V dot (unit roundoff 2^-11 = 4.9e-4
#   per weight) and the output is rounded to fp16 (<= 4.9e-4 relative): 4e-3 = 8 roundoffs.
# bf16 (CUDA only): same two roundings at 2^-9 = 2e-3 each: 1.6e-2 = 8 roundoffs.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def _seqs(spec: list[tuple[int | None, tuple[int, int]]], block_size: int) -> list[tuple[int, int]]:
    """Resolve [(q_len or None = whole context, (a, b) = a * block_size + b context)] pairs."""
    out = []
    for q_len, (a, b) in spec:
        ctx = a * block_size + b
        out.append((ctx if q_len is None else q_len, ctx))
    return out


def _check(
    batch,
    *,
    dtype: torch.dtype,
    num_kv_splits: int | None = None,
    sliding_window: int | None = None,
    causal: bool = True,
) -> torch.Tensor:
    head_dim = batch.q.shape[-1]
    kwargs = dict(
        batch.kwargs(), scale=head_dim**-0.5, sliding_window=sliding_window, causal=causal
    )
    out = paged_attention(
        batch.q, batch.k_cache, batch.v_cache, num_kv_splits=num_kv_splits, **kwargs
    )
    ref = paged_attention_ref(batch.q.float(), batch.k_cache, batch.v_cache, **kwargs)
    assert out.dtype == dtype and out.shape == batch.q.shape
    assert not out.isnan().any()
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)
    return out


# Context specs as (a, b) = a * block_size + b.
ONE, BS_M1, BS, BS_P1 = (0, 1), (1, -1), (1, 0), (1, 1)
DECODE_7 = [(1, ONE), (1, BS_M1), (1, BS), (1, BS_P1), (1, (2, 3)), (1, (5, 0)), (1, (3, 7))]
PREFILL_3 = [(None, BS_M1), (None, BS), (None, BS_P1)]
CHUNKED_7 = [
    (5, (2, 0)),
    (None, ONE),
    (3, BS_P1),
    (16, (1, 16)),
    (2, (4, 1)),
    (None, (0, 9)),
    (7, (3, 2)),
]
MIXED_7 = [(1, (3, 5)), (None, BS_P1), (1, ONE), (6, (2, 2)), (1, BS), (0, (1, 3)), (4, BS_M1)]
MIXED_3 = [(9, (2, 7)), (1, (4, 0)), (None, BS)]

CASES = [
    # id, seqs, (Hq, Hkv), head_dim, block_size, dtype, num_kv_splits, sliding_window
    ("decode-1-ctx1", [(1, ONE)], (4, 4), 64, 16, torch.float32, None, None),
    ("decode-3-edges", [(1, BS_M1), (1, BS), (1, BS_P1)], (8, 2), 80, 32, torch.float32, 1, None),
    ("decode-7", DECODE_7, (9, 3), 128, 16, torch.float16, None, None),
    ("decode-7-split3", DECODE_7, (16, 2), 64, 32, torch.float16, 3, None),
    ("decode-3-window-split2", DECODE_7[3:6], (8, 2), 128, 16, torch.float16, 2, 17),
    ("prefill-1", [(None, BS_P1)], (4, 4), 128, 16, torch.float32, None, None),
    ("prefill-3", PREFILL_3, (9, 3), 64, 32, torch.float16, None, None),
    ("prefill-7-chunked", CHUNKED_7, (16, 2), 80, 16, torch.float32, None, None),
    ("prefill-3-split2", PREFILL_3, (8, 2), 64, 16, torch.float32, 2, None),
    ("prefill-1-long-chunk", [(40, (3, 1))], (16, 2), 64, 32, torch.float16, None, None),
    ("mixed-7", MIXED_7, (4, 4), 80, 32, torch.float16, None, None),
    ("mixed-3-split4", MIXED_3, (16, 2), 128, 16, torch.float32, 4, None),
    ("mixed-7-window", MIXED_7, (9, 3), 64, 32, torch.float32, None, 20),
    ("mixed-3-window-split3", MIXED_3, (8, 2), 80, 16, torch.float32, 3, 9),
]


@pytest.mark.parametrize(
    "spec,heads,head_dim,block_size,dtype,num_kv_splits,sliding_window",
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_matches_reference(
    paged_batch, device, spec, heads, head_dim, block_size, dtype, num_kv_splits, sliding_window
):
    batch = paged_batch(
        _seqs(spec, block_size),
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=device,
    )
    _check(batch, dtype=dtype, num_kv_splits=num_kv_splits, sliding_window=sliding_window)


# Encoders: every sequence's whole prompt in one chunk (q_len None), lengths 17, 1, 37, 15 at
# block size 16. A window of 5 cuts both sides of most queries; fp32's 16-key tiles and 16-token
# query tiles (GQA 4) make a tile's key range start past 0 and end before seq_len.
PROMPTS_4 = [(None, BS_P1), (None, ONE), (None, (2, 5)), (None, BS_M1)]
CHUNKS_3 = [(5, (2, 0)), (None, BS_P1), (3, (1, 3))]  # (the semantics hold over a prefix too)
NONCAUSAL_CASES = [
    # id, seqs, (Hq, Hkv), head_dim, block_size, dtype, num_kv_splits, sliding_window
    ("prompts-4", PROMPTS_4, (8, 2), 80, 16, torch.float32, None, None),
    ("prompts-4-window", PROMPTS_4, (8, 2), 96, 16, torch.float32, None, 5),
    ("prompts-4-bf16", PROMPTS_4, (4, 4), 96, 16, torch.bfloat16, None, None),
    ("prompts-4-bf16-window", PROMPTS_4, (9, 3), 80, 16, torch.bfloat16, None, 9),
    ("prompts-3-window-split2", PROMPTS_4[1:], (8, 2), 64, 32, torch.float32, 2, 7),
    ("chunks-over-prefix", CHUNKS_3, (8, 2), 64, 16, torch.float32, None, None),
    # one-token sequences only: the decode-only launch, split and merged in the kernel
    ("one-token-split2", [(1, (2, 3)), (None, ONE), (1, BS)], (8, 2), 64, 16, torch.float32, 2, 4),
]


@pytest.mark.parametrize(
    "spec,heads,head_dim,block_size,dtype,num_kv_splits,sliding_window",
    [c[1:] for c in NONCAUSAL_CASES],
    ids=[c[0] for c in NONCAUSAL_CASES],
)
def test_non_causal_matches_reference(
    paged_batch, device, spec, heads, head_dim, block_size, dtype, num_kv_splits, sliding_window
):
    """``causal=False`` (bidirectional encoders): every query sees its whole sequence, or the
    keys within ``|k - q| < w``. Where a sequence has more than one query, that differs from
    causal attention; a one-token sequence's query sees the same keys either way."""
    batch = paged_batch(
        _seqs(spec, block_size),
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=device,
    )
    checks = dict(dtype=dtype, num_kv_splits=num_kv_splits, sliding_window=sliding_window)
    out = _check(batch, causal=False, **checks)
    causal = _check(batch, **checks)
    if batch.max_seqlen_q == 1:
        assert torch.equal(out, causal)
    else:
        assert not torch.allclose(out.float(), causal.float(), atol=0.1, rtol=0.1)


SCORE_CASES = [
    # id, seqs, (Hq, Hkv), head_dim, dtype, num_kv_splits, sliding_window, softcap, sinks
    ("mixed-7-softcap-window", MIXED_7, (9, 3), 64, torch.float32, None, 20, 3.0, False),
    ("decode-7-sinks-split3", DECODE_7, (16, 2), 64, torch.float16, 3, None, None, True),
    ("mixed-3-both-split4", MIXED_3, (8, 2), 128, torch.float32, 4, None, 4.0, True),
    ("prefill-3-sinks", PREFILL_3, (8, 2), 80, torch.float32, None, 9, None, True),
]


@pytest.mark.parametrize(
    "spec,heads,head_dim,dtype,num_kv_splits,sliding_window,softcap,with_sinks",
    [c[1:] for c in SCORE_CASES],
    ids=[c[0] for c in SCORE_CASES],
)
def test_softcap_and_sinks_match_reference(
    paged_batch,
    device,
    spec,
    heads,
    head_dim,
    dtype,
    num_kv_splits,
    sliding_window,
    softcap,
    with_sinks,
):
    """Gemma 2's soft-capped scores and gpt-oss's sinks, split and unsplit, beside windows."""
    batch = paged_batch(
        _seqs(spec, 16),
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
        device=device,
    )
    # bf16 sinks, as a model holds them: the launcher takes them to fp32
    sinks = torch.linspace(-1.0, 2.5, heads[0], device=device) if with_sinks else None
    kwargs = dict(
        batch.kwargs(),
        scale=head_dim**-0.5 * 4,  # large scores, so that a cap of 3-4 bends them
        sliding_window=sliding_window,
        softcap=softcap,
    )
    out = paged_attention(
        batch.q, batch.k_cache, batch.v_cache, num_kv_splits=num_kv_splits, sinks=sinks, **kwargs
    )
    ref = paged_attention_ref(batch.q.float(), batch.k_cache, batch.v_cache, sinks=sinks, **kwargs)
    assert not out.isnan().any()
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)


CHUNK_CASES = [
    # id, seqs, (Hq, Hkv), head_dim, dtype, num_kv_splits, sliding_window, attention_chunk
    ("mixed-7-chunk8", MIXED_7, (8, 2), 64, torch.float32, None, None, 8),  # < a key tile
    ("prefill-7-chunk20-window9", CHUNKED_7, (9, 3), 80, torch.float32, None, 9, 20),
    ("decode-7-chunk24-split3", DECODE_7, (16, 2), 64, torch.float16, 3, None, 24),
    ("mixed-3-chunk16-split2", MIXED_3, (8, 2), 64, torch.float32, 2, 30, 16),
]


@pytest.mark.parametrize(
    "spec,heads,head_dim,dtype,num_kv_splits,sliding_window,attention_chunk",
    [c[1:] for c in CHUNK_CASES],
    ids=[c[0] for c in CHUNK_CASES],
)
def test_attention_chunk_matches_reference(
    paged_batch,
    device,
    interpreter_order,
    spec,
    heads,
    head_dim,
    dtype,
    num_kv_splits,
    sliding_window,
    attention_chunk,
):
    """Chunked local attention (Llama 4): a query at ``q`` sees no key before ``q // C * C``,
    beside a window (both lower bounds) and through split-KV runs, in both reduction orders;
    where a chunk cuts, the output differs from the unchunked one."""
    batch = paged_batch(
        _seqs(spec, 16),
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
        device=device,
    )
    kwargs = dict(batch.kwargs(), scale=head_dim**-0.5, sliding_window=sliding_window)
    out = paged_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        num_kv_splits=num_kv_splits,
        attention_chunk=attention_chunk,
        **kwargs,
    )
    ref = paged_attention_ref(
        batch.q.float(), batch.k_cache, batch.v_cache, attention_chunk=attention_chunk, **kwargs
    )
    assert not out.isnan().any()
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)
    unchunked = paged_attention_ref(batch.q.float(), batch.k_cache, batch.v_cache, **kwargs)
    assert not torch.allclose(ref, unchunked, atol=0.1, rtol=0.1)


def test_attention_chunk_never_reads_key_tiles_before_the_chunk(paged_batch, device):
    """Decode rows whose chunk starts on a key-tile boundary (fp32 tiles of 16 keys, chunks of
    32): every cached key and value before the chunk is NaN, and the output is still the
    reference's over the intact cache -- those tiles are never loaded."""
    seqs = _seqs([(1, (2, 5)), (1, (4, 1)), (1, (5, 0)), (1, BS)], 16)
    batch = paged_batch(
        seqs, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32,
        device=device,
    )  # fmt: skip
    kwargs = dict(batch.kwargs(), scale=64**-0.5, attention_chunk=32)
    ref = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, **kwargs)
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    for s, (_, ctx) in enumerate(seqs):
        for position in range((ctx - 1) // 32 * 32):
            block = int(batch.block_tables[s, position // 16])
            k_cache[block, position % 16] = float("nan")
            v_cache[block, position % 16] = float("nan")
    for splits in (1, 2):
        out = paged_attention(batch.q, k_cache, v_cache, num_kv_splits=splits, **kwargs)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_auto_split_kv_long_decode(paged_batch, device):
    """Few sequences with long contexts: the automatic choice splits, and the merge is exact."""
    seqs = [(1, 1100), (1, 17), (1, 600)]
    assert choose_num_kv_splits(num_seqs=3, num_kv_heads=2, max_seqlen_q=1, max_seqlen_k=1100) == 2
    batch = paged_batch(
        seqs,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        device=device,
    )
    split = _check(batch, dtype=torch.float32)
    unsplit = _check(batch, dtype=torch.float32, num_kv_splits=1)
    torch.testing.assert_close(split, unsplit, atol=1e-5, rtol=1e-5)


def test_choose_num_kv_splits_is_a_fixed_function_of_shapes():
    # Prefill or mixed batches never split; decode splits only when it has few programs and
    # long contexts, and never beyond the cap.
    assert choose_num_kv_splits(num_seqs=1, num_kv_heads=1, max_seqlen_q=2, max_seqlen_k=9000) == 1
    assert choose_num_kv_splits(num_seqs=1, num_kv_heads=8, max_seqlen_q=1, max_seqlen_k=100) == 1
    assert (
        choose_num_kv_splits(num_seqs=256, num_kv_heads=8, max_seqlen_q=1, max_seqlen_k=8192) == 1
    )
    assert choose_num_kv_splits(num_seqs=1, num_kv_heads=8, max_seqlen_q=1, max_seqlen_k=8192) == 16
    assert (
        choose_num_kv_splits(num_seqs=1, num_kv_heads=1, max_seqlen_q=1, max_seqlen_k=10**6) == 28
    )


def _waves_efficiency(programs: int, splits: int, num_sms: int) -> float:
    waves = programs * splits / num_sms
    return waves / math.ceil(waves)


@pytest.mark.parametrize(
    ("num_seqs", "num_kv_heads", "max_seqlen_k", "num_sms", "splits"),
    [
        (1, 8, 16384, 132, 16),  # 128 programs: one wave, 97 % full
        (1, 8, 16384, 108, 11),  # an A100: 88 of 108 (12 would split 32 key blocks as 11 does)
        (2, 8, 16384, 132, 7),  # 112 programs
        (1, 8, 2048, 132, 4),  # 4 key blocks of 512: no more splits than that
        (13, 8, 8192, 132, 6),  # 104 programs, below 80 % of the SMs: 624 = 4.7 full waves
        (14, 8, 8192, 132, 1),  # 112 programs fill 80 %: no split
        (64, 3, 4096, 132, 1),  # 192 programs: more than a wave already
    ],
)
def test_split_choice_follows_wave_efficiency_for_the_sm_count(
    num_seqs: int, num_kv_heads: int, max_seqlen_k: int, num_sms: int, splits: int
):
    """FlashAttention's rule over our (sequence, KV head) programs: the fewest splits whose last
    wave is nearly as full as the best choice's, each split keeping >= 512 keys."""
    got = choose_num_kv_splits(
        num_seqs=num_seqs,
        num_kv_heads=num_kv_heads,
        max_seqlen_q=1,
        max_seqlen_k=max_seqlen_k,
        num_sms=num_sms,
    )
    assert got == splits
    programs = num_seqs * num_kv_heads
    if splits > 1:  # each split keeps >= 512 keys, and the waves are fuller than unsplit
        assert splits <= max_seqlen_k // 512
        unsplit = _waves_efficiency(programs, 1, num_sms)
        assert _waves_efficiency(programs, splits, num_sms) > unsplit


def test_launch_record_names_every_compile_time_argument():
    """The launcher and ``ci/aot_compile.py`` both take the kernel's constexprs from
    ``AttentionLaunch``: a constexpr added to the kernel but not to the record fails here."""
    params = inspect.signature(_paged_attention_kernel.fn).parameters.values()
    constexprs = {p.name for p in params if "constexpr" in str(p.annotation)}
    shapes = AttentionShapes(
        num_tokens=5, num_q_heads=8, num_kv_heads=2, head_dim=80, block_size=16, num_seqs=2
    )
    launch = attention_launch(
        shapes,
        dtype=torch.float16,
        max_seqlen_q=4,
        max_seqlen_k=40,
        sliding_window=None,
        num_kv_splits=None,
    )
    assert set(launch.constexprs()) == constexprs
    assert launch.constexprs()["TOKENS_PER_TILE"] == 64 // 4
    assert launch.grid == (5 // 16 + 2, 2, 1)


@pytest.mark.parametrize(
    "spec,dtype,num_kv_splits",
    [(MIXED_7, torch.float32, None), (DECODE_7, torch.float16, 2)],
    ids=["mixed-fp32", "decode-fp16-split2"],
)
def test_block_size_invariance(paged_batch, device, spec, dtype, num_kv_splits):
    """The same tokens laid out in blocks of 16 and of 32 give the same output."""
    seqs = _seqs(spec, 16)
    outs = []
    for block_size in (16, 32):
        batch = paged_batch(
            seqs,
            num_q_heads=8,
            num_kv_heads=2,
            head_dim=64,
            block_size=block_size,
            dtype=dtype,
            device=device,
            seed=7,
        )
        outs.append(_check(batch, dtype=dtype, num_kv_splits=num_kv_splits))
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(outs[0], outs[1], atol=atol, rtol=rtol)


def test_strided_q_out_and_caller_workspace(paged_batch, device):
    """q and out may be views with a row stride (e.g. slices of a fused QKV buffer); a
    caller-provided split-KV workspace is used as is, whatever garbage it holds."""
    batch = paged_batch(
        _seqs(MIXED_3, 16),
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        device=device,
    )
    num_tokens = batch.q.shape[0]
    fused = torch.randn(num_tokens, 3 * 8 * 64, device=device)
    q = fused[:, : 8 * 64].view(num_tokens, 8, 64)
    q.copy_(batch.q)
    out_buf = torch.full((num_tokens, 2, 8, 64), float("nan"), device=device)
    out = out_buf[:, 1]
    splits = 3
    workspace = torch.full(
        (
            workspace_numel(num_tokens=num_tokens, num_q_heads=8, head_dim=64, num_kv_splits=splits)
            + 5,
        ),
        float("nan"),
        device=device,
    )
    kwargs = dict(batch.kwargs(), scale=0.125)
    result = paged_attention(
        q,
        batch.k_cache,
        batch.v_cache,
        num_kv_splits=splits,
        out=out,
        workspace=workspace,
        **kwargs,
    )
    assert result.data_ptr() == out.data_ptr()
    ref = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, **kwargs)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert out_buf[:, 0].isnan().all()  # the other half of the out buffer is untouched


def test_empty_batch(device):
    q = torch.empty(0, 4, 64, device=device)
    cache = torch.zeros(2, 16, 4, 64, device=device)
    out = paged_attention(
        q,
        cache,
        cache,
        block_tables=torch.zeros(0, 1, dtype=torch.int32, device=device),
        seq_lens=torch.zeros(0, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.zeros(1, dtype=torch.int32, device=device),
        scale=0.125,
        max_seqlen_q=0,
        max_seqlen_k=0,
    )
    assert out.shape == (0, 4, 64)


def _valid_args(device: torch.device) -> tuple[tuple, dict]:
    q = torch.randn(3, 8, 64, device=device)
    cache = torch.randn(4, 16, 2, 64, device=device)
    kwargs = dict(
        block_tables=torch.zeros(2, 2, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([5, 20], dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor([0, 1, 3], dtype=torch.int32, device=device),
        scale=0.125,
        max_seqlen_q=2,
        max_seqlen_k=20,
    )
    return (q, cache, cache.clone()), kwargs


def _replace(args: tuple, kwargs: dict, **changes) -> tuple[tuple, dict]:
    names = ("q", "k_cache", "v_cache")
    args = tuple(changes.pop(n, a) for n, a in zip(names, args))
    return args, {**kwargs, **changes}


BAD_INPUTS = {
    "q-2d": lambda a, k: _replace(a, k, q=a[0][:, 0]),
    "q-int": lambda a, k: _replace(a, k, q=a[0].to(torch.int32)),
    "cache-dtype": lambda a, k: _replace(a, k, k_cache=a[1].half(), v_cache=a[2].half()),
    "kv-shape-mismatch": lambda a, k: _replace(a, k, v_cache=a[2][:3]),
    "head-dim-mismatch": lambda a, k: _replace(a, k, q=a[0].new_zeros(3, 8, 32)),
    "gqa-not-divisible": lambda a, k: _replace(a, k, q=a[0].new_zeros(3, 9, 64)),
    "cache-not-contiguous": lambda a, k: _replace(a, k, k_cache=a[1].transpose(0, 1)),
    "q-last-dim-strided": lambda a, k: _replace(a, k, q=a[0].transpose(1, 2)),
    "block-tables-int64": lambda a, k: _replace(a, k, block_tables=k["block_tables"].long()),
    "seq-lens-shape": lambda a, k: _replace(a, k, seq_lens=k["seq_lens"][:1]),
    "cu-seqlens-shape": lambda a, k: _replace(a, k, cu_seqlens_q=k["cu_seqlens_q"][:2]),
    "table-too-small": lambda a, k: _replace(a, k, max_seqlen_k=33),
    "bad-window": lambda a, k: _replace(a, k, sliding_window=0),
    "causal-not-bool": lambda a, k: _replace(a, k, causal=None),
    "bad-chunk": lambda a, k: _replace(a, k, attention_chunk=0),
    "chunk-not-causal": lambda a, k: _replace(a, k, attention_chunk=8, causal=False),
    "bad-splits": lambda a, k: _replace(a, k, num_kv_splits=0),
    "out-dtype": lambda a, k: _replace(a, k, out=a[0].new_zeros(3, 8, 64).half()),
    "small-workspace": lambda a, k: _replace(a, k, num_kv_splits=2, workspace=a[0].new_zeros(10)),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_validation_raises_value_error(device, case):
    args, kwargs = BAD_INPUTS[case](*_valid_args(device))
    with pytest.raises(ValueError):
        paged_attention(*args, **kwargs)


def test_validation_names_the_offending_values(device):
    args, kwargs = _valid_args(device)
    with pytest.raises(ValueError, match="9.*multiple of.*2"):
        paged_attention(args[0].new_zeros(3, 9, 64), *args[1:], **kwargs)
    with pytest.raises(ValueError, match="33.*2 blocks x 16"):
        paged_attention(*args, **{**kwargs, "max_seqlen_k": 33})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_validation_device_mismatch():
    args, kwargs = _valid_args(torch.device("cuda"))
    with pytest.raises(ValueError, match="cpu"):
        paged_attention(args[0].cpu(), *args[1:], **kwargs)


# ---------------------------------------------------------------------------------------------
# CUDA-only: the cartesian grid and long contexts.

GRID_KINDS = {
    "decode": [
        (1, (0, 1)),
        (1, (1, -1)),
        (1, (3, 1)),
        (1, (40, 3)),
        (1, (1, 0)),
        (1, (9, 9)),
        (1, (100, 0)),
    ],
    "prefill": [
        (None, (1, 1)),
        (None, (2, -1)),
        (None, (5, 3)),
        (64, (6, 0)),
        (None, (0, 1)),
        (33, (2, 1)),
        (None, (8, 0)),
    ],
    "mixed": [
        (1, (50, 2)),
        (None, (3, 3)),
        (1, (0, 1)),
        (17, (4, 0)),
        (1, (1, 0)),
        (128, (20, 5)),
        (1, (2, 1)),
    ],
}


# The full product of kinds x heads x head dims x dtypes at block size 16 (decode batches of 7
# short-to-1.6k contexts pick split-KV automatically), plus block size 32 on a smaller product.
# Every case compiles at most a few kernel variants, keeping the CUDA run to minutes.
GRID = list(
    itertools.product(
        sorted(GRID_KINDS),
        [(4, 4), (8, 2), (9, 3), (16, 2), (32, 8)],
        [64, 80, 96, 128, 256],
        [16],
        [torch.float32, torch.float16, torch.bfloat16],
    )
) + list(
    itertools.product(
        sorted(GRID_KINDS),
        [(8, 2), (32, 8)],
        [64, 128],
        [32],
        [torch.float32, torch.float16, torch.bfloat16],
    )
)


@pytest.mark.cuda
@pytest.mark.parametrize("kind,heads,head_dim,block_size,dtype", GRID)
def test_grid_cuda(paged_batch, device, kind, heads, head_dim, block_size, dtype):
    batch = paged_batch(
        _seqs(GRID_KINDS[kind], block_size),
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=device,
    )
    _check(batch, dtype=dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("context", [1, 2047, 4096, 8191])
@pytest.mark.parametrize("num_kv_splits", [None, 1, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sliding_window", [None, 4096])
def test_long_context_decode_cuda(
    paged_batch, device, context, num_kv_splits, dtype, sliding_window
):
    seqs = [(1, context), (1, context // 2 + 1), (1, 17)]
    batch = paged_batch(
        seqs,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        block_size=16,
        dtype=dtype,
        device=device,
    )
    _check(batch, dtype=dtype, num_kv_splits=num_kv_splits, sliding_window=sliding_window)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_long_context_chunked_prefill_cuda(paged_batch, device, dtype):
    seqs = [(256, 8192), (1, 5000), (512, 512)]
    batch = paged_batch(
        seqs,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        block_size=32,
        dtype=dtype,
        device=device,
    )
    _check(batch, dtype=dtype)
    _check(batch, dtype=dtype, num_kv_splits=4)
