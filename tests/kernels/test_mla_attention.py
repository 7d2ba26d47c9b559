"""MLA kernel and latent write vs ``reference.mla_attention_ref`` / ``write_latent_ref``.

Batches come from ``build_paged_batch`` (conftest) with one cache "head" of ``R + rope`` lanes:
shuffled block tables and NaN in every slot that holds no live token. Under the interpreter the
cases cover decode-only, prefill-only, chunked and mixed batches; head counts below, at and
above one head block (1, 4, 16, 20); latents that are and are not powers of two (32, 48) with
rope parts 16 and 8; split-KV off, explicit and automatic; fp32, fp16 and bf16; and the GPU's
tree reduction order. DeepSeek-V3's own shape (128 heads, 512 + 64) runs on CUDA only.
"""

from __future__ import annotations

import pytest
import torch

from paged_serve.kernels.reference import mla_attention_ref, write_latent_ref
from paged_serve.kernels.triton.kv_write import write_latent
from paged_serve.kernels.triton.mla_attention import MlaShapes, mla_attention, mla_launch

# fp32: summation order and exp2 vs exp only (~1 ulp of O(1) values), as for paged attention.
# fp16/bf16: softmax weights rounded before the P.V dot and the output rounded, 8 roundoffs.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
DECODE_7 = [(1, 1), (1, 15), (1, 16), (1, 17), (1, 35), (1, 80), (1, 55)]
PREFILL_3 = [(15, 15), (16, 16), (17, 17)]
CHUNKED_5 = [(5, 32), (1, 1), (3, 17), (16, 32), (7, 51)]
MIXED_5 = [(1, 53), (17, 17), (1, 1), (6, 34), (0, 19)]


def _batch(paged_batch, device, seqs, heads, latent, rope, dtype, block_size=16, seed=0):
    batch = paged_batch(
        seqs,
        num_q_heads=heads,
        num_kv_heads=1,
        head_dim=latent + rope,
        block_size=block_size,
        dtype=dtype,
        device=device,
        seed=seed,
    )
    return batch, batch.k_cache[:, :, 0]  # [num_blocks, block_size, R + rope]


def _check(batch, cache, *, latent, dtype, num_kv_splits=None):
    kwargs = dict(batch.kwargs(), scale=0.7 / (latent**0.5), kv_lora_rank=latent)
    out = mla_attention(batch.q, cache, num_kv_splits=num_kv_splits, **kwargs)
    ref = mla_attention_ref(batch.q.float(), cache.float(), **kwargs)
    assert out.dtype == dtype and out.shape == (*batch.q.shape[:2], latent)
    assert not out.isnan().any()
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)


CASES = [
    # id, seqs, heads, latent, rope, dtype, num_kv_splits
    ("decode-7-h4", DECODE_7, 4, 32, 16, torch.float32, None),
    ("decode-7-h16-split3", DECODE_7, 16, 48, 8, torch.float16, 3),
    ("decode-3-h20-split2", DECODE_7[2:5], 20, 32, 16, torch.bfloat16, 2),
    ("decode-1-h1", [(1, 40)], 1, 32, 16, torch.float32, 4),
    ("prefill-3-h4", PREFILL_3, 4, 48, 8, torch.float32, None),
    ("chunked-5-h16", CHUNKED_5, 16, 32, 16, torch.float32, None),
    ("chunked-5-h20-split2", CHUNKED_5, 20, 48, 8, torch.float16, 2),
    ("mixed-5-h4", MIXED_5, 4, 32, 16, torch.bfloat16, None),
]


@pytest.mark.parametrize(
    "seqs,heads,latent,rope,dtype,num_kv_splits", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_matches_reference(paged_batch, device, seqs, heads, latent, rope, dtype, num_kv_splits):
    batch, cache = _batch(paged_batch, device, seqs, heads, latent, rope, dtype)
    _check(batch, cache, latent=latent, dtype=dtype, num_kv_splits=num_kv_splits)


def test_in_the_gpus_reduction_order(paged_batch, device, interpreter_order):
    batch, cache = _batch(paged_batch, device, MIXED_5, 20, 48, 8, torch.float32)
    _check(batch, cache, latent=48, dtype=torch.float32, num_kv_splits=3)


def test_automatic_split_kv_for_a_long_decode(paged_batch, device):
    """Two long decodes with few head blocks fill few multiprocessors: the launch splits."""
    seqs = [(1, 1500), (1, 1100)]
    shapes = MlaShapes(2, 4, 32, 16, 16, 2)
    launch = mla_launch(
        shapes, dtype=torch.float32, max_seqlen_q=1, max_seqlen_k=1500, num_kv_splits=None,
        num_sms=132,
    )  # fmt: skip
    assert launch.split
    batch, cache = _batch(paged_batch, device, seqs, 4, 32, 16, torch.float32)
    _check(batch, cache, latent=32, dtype=torch.float32)


def test_block_size_does_not_change_the_result(paged_batch, device):
    outs = []
    for block_size in (16, 32):
        batch, cache = _batch(
            paged_batch, device, CHUNKED_5, 4, 32, 16, torch.float32, block_size=block_size
        )
        kwargs = dict(batch.kwargs(), scale=0.2, kv_lora_rank=32)
        outs.append(mla_attention(batch.q, cache, **kwargs))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-6)


def test_empty_batch(device):
    q = torch.empty(0, 4, 48, device=device)
    cache = torch.zeros(2, 16, 48, device=device)
    tables = torch.zeros(0, 1, dtype=torch.int32, device=device)
    lens = torch.zeros(0, dtype=torch.int32, device=device)
    cu = torch.zeros(1, dtype=torch.int32, device=device)
    out = mla_attention(
        q, cache, block_tables=tables, seq_lens=lens, cu_seqlens_q=cu, scale=1.0,
        kv_lora_rank=32, max_seqlen_q=0, max_seqlen_k=0,
    )  # fmt: skip
    assert out.shape == (0, 4, 32)


def _valid(device):
    return dict(
        q=torch.randn(3, 4, 48, device=device),
        latent_cache=torch.randn(4, 16, 48, device=device),
        block_tables=torch.zeros(2, 2, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([3, 1], dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor([0, 2, 3], dtype=torch.int32, device=device),
        scale=0.1,
        kv_lora_rank=32,
        max_seqlen_q=2,
        max_seqlen_k=3,
    )


BAD = {
    "q-2d": ("q", lambda t: t[0], "q must be"),
    "cache-4d": ("latent_cache", lambda t: t[:, :, None], "latent_cache must be"),
    "width-mismatch": ("latent_cache", lambda t: t[..., :40].contiguous(), "40 wide"),
    "rank-too-wide": ("kv_lora_rank", lambda r: 48, "kv_lora_rank must be"),
    "dtype-mismatch": ("latent_cache", lambda t: t.half(), "must share"),
    "tables-int64": ("block_tables", lambda t: t.long(), "block_tables must be int32"),
    "too-long": ("max_seqlen_k", lambda n: 64, "exceeds block_tables capacity"),
    "scale-nan": ("scale", lambda s: float("nan"), "scale must be finite"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_validation_raises_value_error(device, case):
    name, change, message = BAD[case]
    args = _valid(device)
    args[name] = change(args[name])
    q, cache = args.pop("q"), args.pop("latent_cache")
    with pytest.raises(ValueError, match=message):
        mla_attention(q, cache, **args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_latent_matches_reference_exactly(device, dtype):
    gen = torch.Generator().manual_seed(1)
    latent = torch.randn(9, 576, generator=gen).to(dtype=dtype, device=device)
    slots = torch.tensor([5, -1, 17, 0, 63, -1, 30, 31, 48], dtype=torch.int64, device=device)
    cache = torch.full((4, 16, 576), float("nan"), dtype=dtype, device=device)
    want = cache.clone()
    write_latent_ref(latent, want, slot_mapping=slots)
    write_latent(latent, cache, slot_mapping=slots)
    assert torch.equal(cache.nan_to_num(7.0), want.nan_to_num(7.0))
    assert torch.equal(cache.view(-1, 576)[17], latent[2])


def test_write_latent_refuses_a_mismatched_cache(device):
    with pytest.raises(ValueError, match="do not match"):
        write_latent(
            torch.randn(2, 48, device=device),
            torch.zeros(2, 16, 40, device=device),
            slot_mapping=torch.zeros(2, dtype=torch.int64, device=device),
        )


@pytest.mark.cuda
@pytest.mark.parametrize("batch_size", [1, 16, 128])
@pytest.mark.parametrize("context", [1024, 8192])
def test_deepseek_v3_shape_cuda(paged_batch, device, batch_size, context):
    seqs = [(1, context - 37 * (i % 5)) for i in range(batch_size)]
    batch, cache = _batch(paged_batch, device, seqs, 128, 512, 64, torch.bfloat16, block_size=64)
    _check(batch, cache, latent=512, dtype=torch.bfloat16)
