"""The CPU's attention over a quantized KV cache (one-byte codes with a scale per token and KV
head): the C decode kernel and the planned attention (prefill chunks, mixed steps, windows)
equal the fp32 reference over the same cache dequantized first, and the write stores what
``quantize_kv_ref`` makes of each row."""

from __future__ import annotations

import pytest
import torch

from paged_serve.engine.config import cache_root
from paged_serve.engine.platform.cpu.attention import PlannedTorchAttention
from paged_serve.kernels.cpu import decode_attention
from paged_serve.kernels.reference import dequantize_kv_ref, paged_attention_ref, quantize_kv_ref
from tests.engine.platform.cpu.test_cpu_attention import _batch

CODES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
KERNEL = decode_attention.load(cache_root())


def quantized(cache: torch.Tensor, code: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cache [NB, BS, H, D]`` as codes and scales ``[NB, BS, H]`` (NaN rows stay NaN)."""
    codes, scale = quantize_kv_ref(cache.flatten(0, 1), dtype=code)
    return codes.view(cache.shape), scale.view(cache.shape[:3])


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("spec", "window", "in_place"),
    [
        # (q_len or None: the whole context, (a, b): a context of a blocks and b tokens)
        ([(1, (0, 5)), (1, (2, 8)), (1, (1, 1))], None, True),  # decode rows: the C kernel
        ([(1, (2, 1)), (1, (4, 6))], 16, True),  # decode rows in a window
        ([(1, (80, 3)), (1, (2, 2))], None, True),  # a row of 1283 tokens: two pieces
        ([(None, (0, 9)), (1, (1, 14)), (5, (1, 5))], None, False),  # a mixed step: the plan
        ([(7, (2, 8))], 8, False),  # a prefill chunk in a window
    ],
)
def test_attention_over_codes_equals_the_dequantized_reference(
    code, q_dtype, spec, window, in_place
):
    if in_place and KERNEL is None:
        pytest.skip("no C compiler here")
    batch = _batch(spec, (6, 2), 64, 16, torch.float32)
    k_codes, k_scale = quantized(batch.k_cache, code)
    v_codes, v_scale = quantized(batch.v_cache, code)
    k_ref = dequantize_kv_ref(k_codes, k_scale)
    v_ref = dequantize_kv_ref(v_codes, v_scale)
    meta = {
        "block_tables": batch.block_tables,
        "seq_lens": batch.seq_lens,
        "cu_seqlens_q": batch.cu_seqlens_q,
        "scale": 0.125,
        "max_seqlen_q": batch.max_seqlen_q,
        "max_seqlen_k": batch.max_seqlen_k,
        "sliding_window": window,
    }
    q = batch.q.to(q_dtype)
    want = paged_attention_ref(q.float(), k_ref, v_ref, **meta)
    backend = PlannedTorchAttention(decode_kernel=KERNEL)
    if in_place:
        assert backend._decodes_in_place(q, k_codes, v_codes, batch.seq_lens, (k_scale, v_scale))
    got = backend.paged_attention(q, k_codes, v_codes, k_scale=k_scale, v_scale=v_scale, **meta)
    tolerance = 2e-5 if q_dtype == torch.float32 else 2e-2  # fp32 sums; one bf16 rounding of q
    torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("code", CODES)
def test_the_write_stores_codes_and_scales(code):
    torch.manual_seed(0)
    key, value = torch.randn(5, 2, 64), torch.randn(5, 2, 64) * 3
    k_cache = torch.zeros(4, 16, 2, 64, dtype=code)
    v_cache = torch.zeros_like(k_cache)
    k_scale, v_scale = torch.ones(4, 16, 2), torch.ones(4, 16, 2)
    slots = torch.tensor([3, -1, 17, 40, 63])
    PlannedTorchAttention(decode_kernel=KERNEL).write_kv(
        key, value, k_cache, v_cache, slot_mapping=slots, k_scale=k_scale, v_scale=v_scale
    )
    want_codes, want_scale = quantize_kv_ref(value, dtype=code)
    kept = [0, 2, 3, 4]
    flat_codes, flat_scale = v_cache.flatten(0, 1), v_scale.flatten(0, 1)
    assert torch.equal(flat_codes[slots[kept]].float(), want_codes[kept].float())
    assert torch.equal(flat_scale[slots[kept]], want_scale[kept])
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots[kept]] = False
    assert (flat_scale[untouched] == 1).all() and (flat_codes[untouched].float() == 0).all()
    k_back = dequantize_kv_ref(
        k_cache.flatten(0, 1)[slots[kept]], k_scale.flatten(0, 1)[slots[kept]]
    )
    # codes, not garbage: within half a step of the code (int8: amax / 254; fp8: 3 or 2 bits)
    bound = {torch.int8: 1 / 200, torch.float8_e4m3fn: 1 / 16, torch.float8_e5m2: 1 / 8}[code]
    assert (k_back - key[kept]).abs().max() <= key.abs().max() * bound


@pytest.mark.parametrize("code", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8])
def test_the_c_kernel_widens_every_code_byte_exactly(code):
    """Each of the 256 bytes as a V code of scale 1 in a one-token context: attention returns
    the V row itself, which must be torch's conversion of the codes, bit for bit (NaN codes
    NaN, e5m2's infinities infinite)."""
    if KERNEL is None:
        pytest.skip("no C compiler here")
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(code).view(4, 1, 1, 64)
    k_codes = torch.zeros_like(codes)
    scale = torch.ones(4, 1, 1)
    q = torch.randn(4, 1, 64)
    out = KERNEL.attend(
        q,
        k_codes,
        codes,
        block_tables=torch.arange(4, dtype=torch.int32)[:, None],
        seq_lens=torch.ones(4, dtype=torch.int32),
        scale=0.125,
        scales=(scale, scale),
    )
    torch.testing.assert_close(
        out.view(256), codes.view(256).float(), rtol=0, atol=0, equal_nan=True
    )
