"""The quantized latent cache (multi-head latent attention): int8 / fp8 codes with one fp32 scale
per token, each ``[kv_lora_rank + rope]`` entry quantized as one head.

* ``write_latent`` quantizes as ``write_latent_ref`` (``quantize_kv_ref``) does: codes within
  one step of the reference's (they are equal: the kernel rounds in fp32 itself), scales to
  1e-6 relative, and a slot of -1 gets neither codes nor a scale.
* ``mla_attention`` over the codes and scales equals ``mla_attention_ref`` in float64 over the
  same cache dequantized first (``code * scale``): decode, prefill chunks and mixed batches,
  split-KV with the fused merge and with the reduce kernel, int8 and fp8 e4m3, q in fp32 and
  bf16, in both interpreter reduction orders; and it stays close to attention over the values
  before quantization, a bound a wrong scale fails. fp16 q over tiny e5m2 scales keeps its
  relative precision (the weights are scaled relative to the tile's largest scale).
  DeepSeek-V3's shape (128 heads, 512 + 64, bf16) runs on CUDA only.

Free cache slots hold NaN scales and sentinel codes (NaN for fp8), so each case also checks
that the kernels never read them.
"""

from __future__ import annotations

import pytest
import torch

from paged_serve.kernels.reference import (
    dequantize_kv_ref,
    mla_attention_ref,
    quantize_kv_ref,
    write_latent_ref,
)
from paged_serve.kernels.triton.kv_write import write_latent
from paged_serve.kernels.triton.mla_attention import mla_attention

I8, E4M3 = torch.int8, torch.float8_e4m3fn
F32, BF16 = torch.float32, torch.bfloat16
CODE_IDS = {I8: "int8", E4M3: "e4m3"}

# Kernel vs float64 reference over the dequantized cache, (atol, rtol). fp32 q: the kernel
# multiplies the scales into scores and weights instead of into the codes, fp32 roundings in
# another order (measured <= 5e-7 on O(1) outputs), within test_mla_attention.py's 1e-5. bf16
# q: the output (and, on a GPU, the softmax weights) rounded to bf16, test_mla_attention.py's
# bound (measured <= 1.2e-2).
TOLERANCES = {F32: (1e-5, 1e-5), BF16: (1.6e-2, 1.6e-2)}

# Mean |quantized - original| / mean |original| of the latent output for random normal entries
# (measured 0.6 - 0.8 % int8, 2 - 3 % e4m3); with the scales doubled it is 100 %.
CLOSE_TO_ORIGINAL = {I8: 0.02, E4M3: 0.05}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bits, for exact comparison (fp8 NaN codes compare unequal as floats)."""
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def _sentinel_codes(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Codes no write produces: -128 for int8, NaN for fp8."""
    if dtype == torch.int8:
        return torch.full(shape, -128, dtype=torch.int8)
    return torch.full(shape, float("nan")).to(dtype)


# ---------------------------------------------------------------------------------- the write


def _entries(num_tokens: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """``[T, C]`` entries over six decades of magnitude, an all-zero entry and one whose largest
    magnitude is a negative outlier."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(num_tokens, width, generator=gen)
    x = x * torch.logspace(-3, 3, num_tokens)[:, None]
    x[0] = 0.0
    x[-1, 5] = -4 * x[-1].abs().max()
    return x.to(dtype)


@pytest.mark.parametrize("code_dtype", [I8, E4M3], ids=CODE_IDS.get)
@pytest.mark.parametrize("dtype,width", [(F32, 48), (BF16, 576)])
def test_write_latent_quantizes_as_the_reference(device, code_dtype, dtype, width):
    num_blocks, block_size, num_tokens = 3, 8, 7
    latent = _entries(num_tokens, width, dtype).to(device)
    slots = torch.tensor([5, -1, 17, 0, 23, -1, 9], dtype=torch.int64, device=device)
    cache = _sentinel_codes((num_blocks, block_size, width), code_dtype).to(device)
    scales = torch.full((num_blocks, block_size), float("nan"), device=device)
    want_cache, want_scales = cache.clone(), scales.clone()

    write_latent(latent, cache, slot_mapping=slots, latent_scale=scales)
    write_latent_ref(latent, want_cache, slot_mapping=slots, latent_scale=want_scales)

    kept = slots >= 0
    codes, expected_scales = quantize_kv_ref(latent[kept][:, None].cpu(), dtype=code_dtype)
    got_codes = cache.view(-1, width)[slots[kept]].cpu().float()
    assert (got_codes - codes[:, 0].float()).abs().max() <= 1  # an int8 step; fp8: equal
    torch.testing.assert_close(
        scales.view(-1)[slots[kept]].cpu(), expected_scales[:, 0], rtol=1e-6, atol=0
    )
    # the kernel stores the reference's bits exactly, and no other slot changed (NaN stays)
    assert torch.equal(_bytes(cache), _bytes(want_cache))
    assert torch.equal(_bytes(scales), _bytes(want_scales))
    assert int(scales.isnan().sum()) == num_blocks * block_size - int(kept.sum())
    assert scales.view(-1)[slots[0]].item() == 1.0  # the all-zero entry: scale 1, codes 0


def test_write_latent_with_every_slot_skipped_changes_nothing(device):
    cache = _sentinel_codes((2, 8, 48), E4M3).to(device)
    scales = torch.full((2, 8), float("nan"), device=device)
    before = cache.clone(), scales.clone()
    skip = torch.full((3,), -1, dtype=torch.int64, device=device)
    write_latent(torch.randn(3, 48, device=device), cache, slot_mapping=skip, latent_scale=scales)
    assert torch.equal(_bytes(cache), _bytes(before[0]))
    assert torch.equal(_bytes(scales), _bytes(before[1]))


BAD_WRITES = {
    "float-cache": (lambda c, s: (c.float(), s), "holds one of"),
    "scale-fp16": (lambda c, s: (c, s.half()), "latent_scale must be fp32"),
    "scale-per-block": (lambda c, s: (c, s[:, :1]), "latent_scale must be fp32"),
}


@pytest.mark.parametrize("case", sorted(BAD_WRITES))
def test_write_latent_refuses_bad_scales(device, case):
    change, message = BAD_WRITES[case]
    cache, scales = change(
        torch.zeros(2, 8, 48, dtype=torch.int8, device=device), torch.ones(2, 8, device=device)
    )
    with pytest.raises(ValueError, match=message):
        write_latent(
            torch.randn(2, 48, device=device),
            cache,
            slot_mapping=torch.zeros(2, dtype=torch.int64, device=device),
            latent_scale=scales,
        )


# ------------------------------------------------------------------------------- the attention


def _quantized_cache(cache: torch.Tensor, code_dtype: torch.dtype):
    """``(codes, scales)`` of a ``build_paged_batch`` latent cache ``[num_blocks, block_size,
    C]``: live slots quantized, free (NaN) slots given NaN scales and sentinel codes."""
    num_blocks, block_size, width = cache.shape
    flat = cache.float().cpu().view(-1, 1, width)
    free = flat.isnan().any(-1)[:, 0]  # [slots]
    codes, scales = quantize_kv_ref(flat.nan_to_num(), dtype=code_dtype)
    codes, scales = codes[:, 0], scales[:, 0]
    codes[free] = _sentinel_codes((int(free.sum()), width), code_dtype)
    scales[free] = float("nan")
    return (
        codes.view(cache.shape).to(cache.device),
        scales.view(num_blocks, block_size).to(cache.device),
    )


DECODE = [(1, 1), (1, 17), (1, 40)]
CHUNKS = [(5, 21), (9, 9)]
MIXED = [(1, 35), (6, 22), (0, 7)]
LATENT, ROPE = 32, 16
CASES = [
    # id, seqs, heads, code dtype, q dtype, num_kv_splits (None: no split), fuse_merge
    ("decode-split2-fused", DECODE, 4, I8, F32, 2, True),
    ("decode", DECODE, 16, E4M3, BF16, None, True),
    ("chunks", CHUNKS, 4, E4M3, F32, None, True),
    ("mixed-split2-reduce", MIXED, 4, I8, BF16, 2, False),
]


def _batch(paged_batch, device, seqs, heads, seed=0):
    batch = paged_batch(
        seqs,
        num_q_heads=heads,
        num_kv_heads=1,
        head_dim=LATENT + ROPE,
        block_size=16,
        dtype=F32,
        device=device,
        seed=seed,
    )
    return batch, batch.k_cache[:, :, 0]  # [num_blocks, block_size, R + rope]


@pytest.mark.parametrize(
    "seqs,heads,code_dtype,q_dtype,num_kv_splits,fuse_merge",
    [c[1:] for c in CASES],
    ids=[f"{c[0]}-{CODE_IDS[c[3]]}-{str(c[4])[6:]}" for c in CASES],
)
def test_attention_matches_reference_over_dequantized_cache(
    paged_batch,
    device,
    interpreter_order,
    seqs,
    heads,
    code_dtype,
    q_dtype,
    num_kv_splits,
    fuse_merge,
):
    batch, cache = _batch(paged_batch, device, seqs, heads)
    codes, scales = _quantized_cache(cache, code_dtype)
    kwargs = dict(batch.kwargs(), scale=0.7 / LATENT**0.5, kv_lora_rank=LATENT)
    q = batch.q.to(q_dtype)
    out = mla_attention(
        q, codes, latent_scale=scales, num_kv_splits=num_kv_splits, fuse_merge=fuse_merge, **kwargs
    )
    dequantized = dequantize_kv_ref(codes, scales).double()  # [num_blocks, block_size, C]
    ref = mla_attention_ref(q.double(), dequantized, **kwargs)
    reference_quantized = mla_attention_ref(q.float(), codes, latent_scale=scales, **kwargs)
    original = mla_attention_ref(q.float(), cache, **kwargs)
    assert out.dtype == q_dtype and out.shape == (*q.shape[:2], LATENT)
    assert not out.isnan().any()
    atol, rtol = TOLERANCES[q_dtype]
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(reference_quantized.double(), ref, atol=1e-5, rtol=1e-5)
    error = (out.float() - original).abs().mean() / original.abs().mean()
    assert error < CLOSE_TO_ORIGINAL[code_dtype]


def test_written_cache_is_close_to_the_original_and_a_wrong_scale_is_not(paged_batch, device):
    """The cache written by the write kernel and read by the attention kernel stays within
    ``CLOSE_TO_ORIGINAL`` of attention over the values written; doubled scales do not."""
    batch, cache = _batch(paged_batch, device, MIXED, 4, seed=1)
    live = ~cache.isnan().any(-1).view(-1)
    slots = live.nonzero().flatten()
    codes = torch.zeros(cache.shape, dtype=I8, device=device)
    scales = torch.zeros(cache.shape[:2], device=device)
    write_latent(
        cache.view(-1, cache.shape[-1])[slots], codes, slot_mapping=slots, latent_scale=scales
    )
    kwargs = dict(batch.kwargs(), scale=0.7 / LATENT**0.5, kv_lora_rank=LATENT)
    original = mla_attention_ref(batch.q, cache, **kwargs)
    magnitude = original.abs().mean()
    out = mla_attention(batch.q, codes, latent_scale=scales, **kwargs)
    assert (out - original).abs().mean() / magnitude < CLOSE_TO_ORIGINAL[I8]
    wrong = mla_attention(batch.q, codes, latent_scale=scales * 2, **kwargs)
    assert (wrong - original).abs().mean() / magnitude > 0.5


BAD_ATTENTION = {
    "float-cache": (lambda c, s: (c.float(), s), "holds one of"),
    "scale-shape": (lambda c, s: (c, s[:1]), "latent_scale must be fp32"),
    "scale-strided": (lambda c, s: (c, s.t().contiguous().t()), "must be contiguous"),
}


@pytest.mark.parametrize("case", sorted(BAD_ATTENTION))
def test_attention_refuses_bad_scales(device, case):
    change, message = BAD_ATTENTION[case]
    codes, scales = change(
        torch.zeros(4, 16, 48, dtype=I8, device=device), torch.ones(4, 16, device=device)
    )
    with pytest.raises(ValueError, match=message):
        mla_attention(
            torch.randn(3, 4, 48, device=device),
            codes,
            block_tables=torch.zeros(2, 2, dtype=torch.int32, device=device),
            seq_lens=torch.tensor([3, 1], dtype=torch.int32, device=device),
            cu_seqlens_q=torch.tensor([0, 2, 3], dtype=torch.int32, device=device),
            scale=0.1,
            kv_lora_rank=32,
            max_seqlen_q=2,
            max_seqlen_k=3,
            latent_scale=scales,
        )


def test_fp16_weights_keep_small_scales(paged_batch, device, interpreter_order):
    """Entries of magnitude ~1e-3 as e5m2 codes have scales near 1e-8: times a softmax weight
    that is far below fp16's smallest subnormal (6e-8), so the kernel scales the weights by
    each scale over the tile's largest and the dot's result by that largest; the output keeps
    fp16's relative precision (test_mla_attention.py's fp16 bound, relative to the size)."""
    batch, cache = _batch(paged_batch, device, MIXED, 4, seed=2)
    codes, scales = _quantized_cache(cache * 1e-3, torch.float8_e5m2)
    kwargs = dict(batch.kwargs(), scale=0.7 / LATENT**0.5, kv_lora_rank=LATENT)
    q = batch.q.half()
    out = mla_attention(q, codes, latent_scale=scales, **kwargs)
    ref = mla_attention_ref(q.double(), dequantize_kv_ref(codes, scales).double(), **kwargs)
    assert out.dtype == torch.float16 and not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, atol=4e-6, rtol=4e-3)


@pytest.mark.cuda
@pytest.mark.parametrize("code_dtype", [I8, E4M3], ids=CODE_IDS.get)
@pytest.mark.parametrize("batch_size", [1, 64])
def test_deepseek_v3_shape_cuda(paged_batch, device, code_dtype, batch_size):
    """128 heads over 512 + 64 entries in bf16, decode at 2K contexts: the builds
    ``ci/aot_compile.py --kv-codes`` checks for spills."""
    seqs = [(1, 2048 - 37 * (i % 5)) for i in range(batch_size)]
    batch = paged_batch(
        seqs, num_q_heads=128, num_kv_heads=1, head_dim=576, block_size=64, dtype=F32,
        device=device,
    )  # fmt: skip
    codes, scales = _quantized_cache(batch.k_cache[:, :, 0], code_dtype)
    kwargs = dict(batch.kwargs(), scale=576**-0.5, kv_lora_rank=512)
    q = batch.q.to(BF16)
    out = mla_attention(q, codes, latent_scale=scales, **kwargs)
    ref = mla_attention_ref(q.double(), dequantize_kv_ref(codes, scales).double(), **kwargs)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, atol=1.6e-2, rtol=1.6e-2)
