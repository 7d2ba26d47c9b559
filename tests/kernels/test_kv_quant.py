"""The quantized KV cache: int8 / fp8 codes with one fp32 scale per token and KV head.

* The write kernel quantizes as ``quantize_kv_ref`` does, bit for bit (codes and scales; the
  kernel rounds in fp32 itself, so there is no one-step slack to allow), and a slot of -1 gets
  neither codes nor a scale.
* The attention kernel over a quantized cache equals ``paged_attention_ref`` over the same codes
  dequantized first (this isolates the kernel's dequantization from the quantization error):
  decode, prefill chunks, split-KV (explicit, the fused merge, the reduce kernel, the automatic
  choice on a long context), sliding windows, soft-cap, sinks, non-causal, head dims 64 and 256,
  every code type, q in fp32 and bf16, in both reduction orders.
* Quantized attention stays close to attention over the original values (a bound a wrong scale
  could not meet), and block copies move codes and scales exactly.

Free cache slots hold NaN scales (and NaN fp8 codes), so each case also checks that the kernels
never read them.
"""

from __future__ import annotations

import pytest
import torch

from paged_serve.kernels.reference import (
    KV_QMAX,
    copy_blocks_ref,
    dequantize_kv_ref,
    paged_attention_ref,
    quantize_kv_ref,
    write_kv_ref,
)
from paged_serve.kernels.triton.block_copy import copy_blocks
from paged_serve.kernels.triton.kv_write import write_kv
from paged_serve.kernels.triton.paged_attention import choose_num_kv_splits, paged_attention

CODES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
CODE_IDS = {torch.int8: "int8", torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}

# Kernel vs the reference over the dequantized cache, (atol, rtol). fp32 q: both sides read the
# same fp32 values (code * scale is one exact-as-torch fp32 multiply), so only summation order
# and exp2 vs exp differ, ~1 ulp of O(1) outputs: test_paged_attention.py's 1e-5. bf16 q: the
# output is rounded to bf16 (2^-9 relative) and, on a GPU, the dequantized tiles and the softmax
# weights are too before the dots: test_paged_attention.py's 8 roundoffs, 1.6e-2.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1.6e-2)}

# Mean |quantized - original| / mean |original| of the attention output, with random normal K/V:
# measured 0.8 % (int8), 3 % (e4m3: 3 mantissa bits), 6 % (e5m2: 2 bits). A scale off by a
# factor of 2 on V doubles the output (100 %); on K it changes every softmax's temperature.
CLOSE_TO_ORIGINAL = {torch.int8: 0.02, torch.float8_e4m3fn: 0.05, torch.float8_e5m2: 0.10}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bits, for exact comparison (fp8 NaN codes compare unequal as floats)."""
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def _sentinel_codes(shape, dtype) -> torch.Tensor:
    """Codes no write produces: -128 for int8, NaN for fp8."""
    if dtype == torch.int8:
        return torch.full(shape, -128, dtype=torch.int8)
    return torch.full(shape, float("nan")).to(dtype)


# ---------------------------------------------------------------------------------- the write


def _keys(num_tokens: int, num_heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    """Random heads over eight decades of magnitude (finite in fp16), with an all-zero head
    and a head whose largest magnitude is a negative outlier."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    x = x * torch.logspace(-5, 3, num_tokens * num_heads).view(num_tokens, num_heads, 1)
    x[0, 0] = 0.0
    x[-1, -1, 3] = -4 * x[-1, -1].abs().max()
    x = x.to(dtype)
    assert x.isfinite().all()
    return x


@pytest.mark.parametrize("code_dtype", CODES, ids=CODE_IDS.get)
@pytest.mark.parametrize(
    "num_tokens,num_kv_heads,head_dim,block_size,dtype",
    [(9, 3, 64, 16, torch.float32), (6, 2, 80, 8, torch.bfloat16), (5, 2, 256, 16, torch.float16)],
)
def test_write_quantizes_as_the_reference(
    device, interpreter_order, code_dtype, num_tokens, num_kv_heads, head_dim, block_size, dtype
):
    num_blocks = 4
    key = _keys(num_tokens, num_kv_heads, head_dim, dtype, seed=1).to(device)
    value = _keys(num_tokens, num_kv_heads, head_dim, dtype, seed=2).to(device)
    gen = torch.Generator().manual_seed(3)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[1::3] = -1
    slot_mapping = slots.to(device)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = _sentinel_codes(shape, code_dtype).to(device)
    v_cache = k_cache.clone()
    k_scale = torch.full(shape[:3], float("nan"), device=device)
    v_scale = k_scale.clone()
    expected = [t.clone() for t in (k_cache, v_cache, k_scale, v_scale)]

    write_kv(
        key, value, k_cache, v_cache, slot_mapping=slot_mapping, k_scale=k_scale, v_scale=v_scale
    )

    kept = slots >= 0
    for x, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        codes, scales = quantize_kv_ref(x[kept], dtype=code_dtype)
        flat = cache.view(-1, num_kv_heads, head_dim)[slot_mapping[kept]]
        assert torch.equal(_bytes(flat), _bytes(codes))
        assert torch.equal(scale.view(-1, num_kv_heads)[slot_mapping[kept]], scales)
    # write_kv_ref writes the same bits, and no other slot changed (NaN scales stay NaN)
    write_kv_ref(
        key,
        value,
        *expected[:2],
        slot_mapping=slot_mapping,
        k_scale=expected[2],
        v_scale=expected[3],
    )
    for got, want in zip((k_cache, v_cache, k_scale, v_scale), expected):
        assert torch.equal(_bytes(got), _bytes(want))
    assert int(k_scale.isnan().sum()) == (num_blocks * block_size - int(kept.sum())) * num_kv_heads


@pytest.mark.parametrize("code_dtype", CODES, ids=CODE_IDS.get)
def test_quantization_rounds_to_nearest_even_and_saturates(device, code_dtype):
    """Hand-computed codes: a head whose amax is QMAX has scale 1, so its codes are the values
    rounded (ties to even: int8 2.5 -> 2, -3.5 -> -4; e4m3 17 -> 16 and 19 -> 20 at spacing
    2; e5m2 9 -> 8 at spacing 2), its amax lane becomes QMAX exactly; an all-zero head gets
    scale 1 and zero codes. The kernel and the reference agree with the table."""
    qmax = KV_QMAX[code_dtype]
    ties = {
        torch.int8: ([2.5, -3.5, 0.5, 1.49], [2, -4, 0, 1]),
        torch.float8_e4m3fn: ([17.0, 19.0, -0.1, 300.0], [16, 20, -0.1015625, 288]),
        torch.float8_e5m2: ([9.0, -11.0, 0.3, 40000.0], [8, -12, 0.3125, 40960]),
    }[code_dtype]
    head_dim = 8
    x = torch.zeros(2, 1, head_dim)
    x[0, 0, 0] = qmax
    x[0, 0, 1:5] = torch.tensor(ties[0])
    want = torch.zeros(head_dim)
    want[0] = qmax
    want[1:5] = torch.tensor(ties[1])

    codes, scale = quantize_kv_ref(x, dtype=code_dtype)
    assert scale.tolist() == [[1.0], [1.0]]
    assert torch.equal(codes[0, 0].float(), want) and not codes[1].float().any()

    cache = torch.zeros(1, 2, 1, head_dim, dtype=code_dtype, device=device)
    scales = torch.zeros(1, 2, 1, device=device)
    slot_mapping = torch.tensor([0, 1], device=device)
    write_kv(
        x.to(device),
        x.to(device),
        cache,
        cache.clone(),
        slot_mapping=slot_mapping,
        k_scale=scales,
        v_scale=scales.clone(),
    )
    assert torch.equal(cache[0, 0, 0].float().cpu(), want) and not cache[0, 1].float().any()
    assert scales.flatten().tolist() == [1.0, 1.0]


def test_write_with_every_slot_skipped_changes_nothing(device):
    shape = (2, 16, 2, 64)
    k_cache = _sentinel_codes(shape, torch.float8_e4m3fn).to(device)
    v_cache = k_cache.clone()
    k_scale = torch.full(shape[:3], float("nan"), device=device)
    v_scale = k_scale.clone()
    before = [t.clone() for t in (k_cache, v_cache, k_scale, v_scale)]
    key = torch.randn(4, 2, 64, device=device)
    skip = torch.full((4,), -1, dtype=torch.int64, device=device)
    write_kv(key, key, k_cache, v_cache, slot_mapping=skip, k_scale=k_scale, v_scale=v_scale)
    for got, want in zip((k_cache, v_cache, k_scale, v_scale), before):
        assert torch.equal(_bytes(got), _bytes(want))


# ------------------------------------------------------------------------------- the attention


def _quantize_cache(cache: torch.Tensor, code_dtype: torch.dtype):
    """``(codes, scales)`` of a ``build_paged_batch`` cache: live slots quantized, free (NaN)
    slots given NaN scales and the sentinel codes, so that reading one poisons the output."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    flat = cache.float().cpu().view(-1, num_kv_heads, head_dim)
    free = flat.isnan().any(-1)  # [slots, Hkv]
    codes, scales = quantize_kv_ref(flat.nan_to_num(), dtype=code_dtype)
    codes[free] = _sentinel_codes((int(free.sum()), head_dim), code_dtype)
    scales[free] = float("nan")
    return (
        codes.view(cache.shape).to(cache.device),
        scales.view(num_blocks, block_size, num_kv_heads).to(cache.device),
    )


# Context specs (q_len or None for the whole context, context) at block size 16.
DECODE = [(1, 1), (1, 15), (1, 17), (1, 55)]
CHUNKS = [(5, 32), (9, 9), (3, 19)]
MIXED = [(1, 53), (6, 34), (17, 17)]
PROMPTS = [(17, 17), (1, 1), (37, 37)]

I8, E4M3, E5M2 = CODES
F32, BF16 = torch.float32, torch.bfloat16
CASES = [
    # id, seqs, (Hq, Hkv), head_dim, code dtype, q dtype, extra arguments (sinks=1: a ramp of
    # sinks; window: sliding_window)
    ("decode", DECODE, (8, 2), 64, I8, F32, {}),
    ("decode-split3-fused", DECODE, (8, 2), 64, E4M3, BF16, dict(num_kv_splits=3)),
    ("chunks", CHUNKS, (8, 2), 64, E5M2, F32, {}),
    ("mixed-split2-reduce", MIXED, (4, 4), 64, I8, BF16, dict(num_kv_splits=2)),
    ("mixed-window", MIXED, (8, 2), 64, E4M3, F32, dict(window=20)),
    ("mixed-capped-sinks-window", MIXED, (8, 2), 64, I8, F32, dict(softcap=3.0, sinks=1, window=9)),
    ("decode-sinks-split2", DECODE, (8, 2), 64, E5M2, F32, dict(sinks=1, num_kv_splits=2)),
    ("prompts-non-causal-window", PROMPTS, (8, 2), 64, E4M3, F32, dict(causal=False, window=5)),
    ("prompts-non-causal", PROMPTS, (4, 2), 64, I8, BF16, dict(causal=False)),
    ("d256-decode-split2", DECODE, (4, 2), 256, I8, F32, dict(num_kv_splits=2)),
    ("d256-chunks", CHUNKS[:2], (4, 2), 256, E5M2, BF16, {}),
    ("d256-mixed-softcap", MIXED[:2], (2, 1), 256, E4M3, F32, dict(softcap=4.0)),
]  # fmt: skip


def _run(batch, code_dtype, q_dtype, extra: dict, device):
    """``(kernel output, reference over the dequantized cache, reference over the original
    values)`` for one case; the codes and scales are the original cache's."""
    head_dim = batch.q.shape[-1]
    extra = dict(extra)
    num_kv_splits = extra.pop("num_kv_splits", None)
    if "window" in extra:
        extra["sliding_window"] = extra.pop("window")
    if extra.pop("sinks", False):
        extra["sinks"] = torch.linspace(-1.0, 2.5, batch.q.shape[1], device=device)
    scale = head_dim**-0.5 * (4 if "softcap" in extra else 1)  # large scores bend under a cap
    kwargs = dict(batch.kwargs(), scale=scale, **extra)
    k_codes, k_scale = _quantize_cache(batch.k_cache, code_dtype)
    v_codes, v_scale = _quantize_cache(batch.v_cache, code_dtype)
    q = batch.q.to(q_dtype)
    out = paged_attention(
        q, k_codes, v_codes, k_scale=k_scale, v_scale=v_scale, num_kv_splits=num_kv_splits, **kwargs
    )
    k_deq, v_deq = dequantize_kv_ref(k_codes, k_scale), dequantize_kv_ref(v_codes, v_scale)
    ref = paged_attention_ref(q.float(), k_deq, v_deq, **kwargs)
    original = paged_attention_ref(q.float(), batch.k_cache, batch.v_cache, **kwargs)
    return out, ref, original


@pytest.mark.parametrize(
    "seqs,heads,head_dim,code_dtype,q_dtype,extra",
    [c[1:] for c in CASES],
    ids=[f"{c[0]}-{CODE_IDS[c[4]]}-{str(c[5])[6:]}" for c in CASES],
)
def test_attention_matches_reference_over_dequantized_cache(
    paged_batch, device, interpreter_order, seqs, heads, head_dim, code_dtype, q_dtype, extra
):
    batch = paged_batch(
        seqs,
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        block_size=16,
        dtype=torch.float32,
        device=device,
    )
    out, ref, original = _run(batch, code_dtype, q_dtype, extra, device)
    assert out.dtype == q_dtype and out.shape == batch.q.shape
    assert not out.isnan().any()
    atol, rtol = TOLERANCES[q_dtype]
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)
    error = (out.float() - original).abs().mean() / original.abs().mean()
    assert error < CLOSE_TO_ORIGINAL[code_dtype]


def test_long_context_decode_splits_automatically(paged_batch, device, interpreter_order):
    """A long decode splits by itself (the fused merge) and still reads every block's scales."""
    seqs = [(1, 1100), (1, 17)]
    assert choose_num_kv_splits(num_seqs=2, num_kv_heads=2, max_seqlen_q=1, max_seqlen_k=1100) > 1
    batch = paged_batch(
        seqs,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        device=device,
    )
    out, ref, original = _run(batch, torch.int8, torch.float32, {}, device)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    error = (out - original).abs().mean() / original.abs().mean()
    assert error < CLOSE_TO_ORIGINAL[torch.int8]


@pytest.mark.parametrize("code_dtype", CODES, ids=CODE_IDS.get)
def test_quantized_attention_is_close_to_the_original(paged_batch, device, code_dtype):
    """The cache written by the write kernel (not by the reference) and read by the attention
    kernel: mean error within ``CLOSE_TO_ORIGINAL`` of attention over the values written; with
    the V scales doubled the same bound fails, so the bound can tell a wrong scale."""
    batch = paged_batch(
        MIXED,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        device=device,
    )
    kwargs = dict(batch.kwargs(), scale=64**-0.5)
    caches = {}
    for name, cache in (("k", batch.k_cache), ("v", batch.v_cache)):
        codes = torch.zeros(cache.shape, dtype=code_dtype, device=device)
        scales = torch.zeros(cache.shape[:3], device=device)
        live = ~cache.isnan().any(-1).any(-1).view(-1)  # slots holding a token
        slots = live.nonzero().flatten()
        values = cache.view(-1, *cache.shape[2:])[slots]
        write_kv(
            values,
            values,
            codes,
            codes.clone(),
            slot_mapping=slots,
            k_scale=scales,
            v_scale=scales.clone(),
        )
        caches[name] = (codes, scales)
    (k_codes, k_scale), (v_codes, v_scale) = caches["k"], caches["v"]
    original = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, **kwargs)
    magnitude = original.abs().mean()
    out = paged_attention(batch.q, k_codes, v_codes, k_scale=k_scale, v_scale=v_scale, **kwargs)
    assert (out - original).abs().mean() / magnitude < CLOSE_TO_ORIGINAL[code_dtype]
    wrong = paged_attention(
        batch.q, k_codes, v_codes, k_scale=k_scale, v_scale=v_scale * 2, **kwargs
    )
    assert (wrong - original).abs().mean() / magnitude > CLOSE_TO_ORIGINAL[code_dtype]


def test_reference_dequantizes_the_gathered_blocks(paged_batch):
    """``paged_attention_ref(k_scale=, v_scale=)`` is the reference over the dequantized
    cache, bit for bit (the kernel tests above compare with the latter)."""
    batch = paged_batch(
        MIXED,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=16,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    k_codes, k_scale = _quantize_cache(batch.k_cache, torch.int8)
    v_codes, v_scale = _quantize_cache(batch.v_cache, torch.int8)
    kwargs = dict(batch.kwargs(), scale=0.25)
    quantized = paged_attention_ref(
        batch.q, k_codes, v_codes, k_scale=k_scale, v_scale=v_scale, **kwargs
    )
    k_deq, v_deq = dequantize_kv_ref(k_codes, k_scale), dequantize_kv_ref(v_codes, v_scale)
    assert torch.equal(quantized, paged_attention_ref(batch.q, k_deq, v_deq, **kwargs))
    assert not torch.equal(
        quantized, paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, **kwargs)
    )


# ---------------------------------------------------------------------------------- block copy


@pytest.mark.parametrize("code_dtype", CODES, ids=CODE_IDS.get)
def test_copy_blocks_moves_codes_and_scales(device, code_dtype):
    """The engine's two calls: the codes ``[L, 2, num_blocks, block_size, Hkv, D]``, then the
    scales ``[L, 2, num_blocks, block_size, Hkv]`` viewed ``[..., Hkv, 1]``; exact, both
    backends."""
    gen = torch.Generator().manual_seed(0)
    num_layers, num_blocks, block_size, num_kv_heads, head_dim = 2, 6, 16, 2, 64
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    values = torch.randn(shape, generator=gen) * 100
    codes = values.clamp(-127, 127).round().to(code_dtype).to(device)
    scales = torch.rand(shape[:5], generator=gen).to(device)
    mapping = torch.tensor([(4, 1), (0, 5), (2, 3)], dtype=torch.int64, device=device)
    for cache in (codes, scales.unsqueeze(-1)):
        original, expected = cache.clone(), cache.clone()
        copy_blocks_ref(expected, block_mapping=mapping)
        copy_blocks(cache, block_mapping=mapping)
        assert torch.equal(_bytes(cache), _bytes(expected))
        for src, dst in mapping.tolist():
            assert torch.equal(_bytes(cache[:, :, dst]), _bytes(original[:, :, src]))
        untouched = [b for b in range(num_blocks) if b not in mapping[:, 1].tolist()]
        assert torch.equal(_bytes(cache[:, :, untouched]), _bytes(original[:, :, untouched]))


# ---------------------------------------------------------------------------------- validation


def _write_args(device):
    shape = (2, 16, 2, 64)
    return dict(
        key=torch.randn(3, 2, 64, device=device),
        value=torch.randn(3, 2, 64, device=device),
        k_cache=torch.zeros(shape, dtype=torch.int8, device=device),
        v_cache=torch.zeros(shape, dtype=torch.int8, device=device),
        slot_mapping=torch.tensor([0, 1, 2], device=device),
        k_scale=torch.zeros(shape[:3], device=device),
        v_scale=torch.zeros(shape[:3], device=device),
    )


BAD_WRITES = {
    "k-scale-alone": dict(v_scale=None),
    "scale-fp16": dict(k_scale=lambda a: a["k_scale"].half()),
    "scale-shape": dict(v_scale=lambda a: a["v_scale"][:, :8]),
    "scale-not-contiguous": dict(k_scale=lambda a: a["k_scale"].transpose(0, 1)),
    "cache-fp16": dict(
        k_cache=lambda a: a["k_cache"].half(), v_cache=lambda a: a["v_cache"].half()
    ),
    "codes-differ": dict(v_cache=lambda a: a["v_cache"].to(torch.float8_e4m3fn)),
    "key-int8": dict(key=lambda a: a["k_cache"][0, :3], value=lambda a: a["k_cache"][0, :3]),
}


@pytest.mark.parametrize("case", sorted(BAD_WRITES))
def test_write_validation_raises_value_error(device, case):
    args = _write_args(device)
    for name, change in BAD_WRITES[case].items():
        args[name] = change(args) if callable(change) else change
    with pytest.raises(ValueError):
        write_kv(
            args.pop("key"), args.pop("value"), args.pop("k_cache"), args.pop("v_cache"), **args
        )


BAD_ATTENTION = {
    "codes-without-scales": dict(k_scale=None, v_scale=None),
    "v-scale-alone": dict(k_scale=None),
    "scale-shape": dict(k_scale=lambda a: a["k_scale"][:1]),
    "scale-fp16": dict(v_scale=lambda a: a["v_scale"].half()),
    "cache-fp32-with-scales": dict(
        k_cache=lambda a: a["q"].new_zeros(4, 16, 2, 64),
        v_cache=lambda a: a["q"].new_zeros(4, 16, 2, 64),
    ),
    "codes-differ": dict(v_cache=lambda a: a["v_cache"].to(torch.float8_e5m2)),
}


@pytest.mark.parametrize("case", sorted(BAD_ATTENTION))
def test_attention_validation_raises_value_error(device, case):
    shape = (4, 16, 2, 64)
    args = dict(
        q=torch.randn(3, 8, 64, device=device),
        k_cache=torch.zeros(shape, dtype=torch.int8, device=device),
        v_cache=torch.zeros(shape, dtype=torch.int8, device=device),
        k_scale=torch.ones(shape[:3], device=device),
        v_scale=torch.ones(shape[:3], device=device),
    )
    for name, change in BAD_ATTENTION[case].items():
        args[name] = change(args) if callable(change) else change
    with pytest.raises(ValueError):
        paged_attention(
            args.pop("q"),
            args.pop("k_cache"),
            args.pop("v_cache"),
            block_tables=torch.zeros(2, 2, dtype=torch.int32, device=device),
            seq_lens=torch.tensor([5, 20], dtype=torch.int32, device=device),
            cu_seqlens_q=torch.tensor([0, 1, 3], dtype=torch.int32, device=device),
            scale=0.125,
            max_seqlen_q=2,
            max_seqlen_k=20,
            **args,
        )
