"""The W4A16 / W8A16 GEMM against ``reference.quantized_gemm_ref`` (fp32 dequantize, matmul).

Cases: 4 and 8 bits; group sizes 32, 64, 128 and per-channel (-1); symmetric and asymmetric
zero points (uint8 and int32); M of 1, 5, 33 (split-K), 100 and 300 (every row tile, no
split); N not a multiple of
the 64-wide tile (72, 200) and K a multiple of the group but not of 128; bias or none; fp32,
bf16 and fp16 activations with fp32 or activation-dtype scales. The reference is checked once
against a float64 dequantize-then-matmul written here, the packing by an exact round trip, and
the launcher's errors by name.
"""

from __future__ import annotations

import pytest
import torch

from paged_serve.kernels.reference import (
    dequantize_ref,
    pack_int_ref,
    quantized_gemm_ref,
    unpack_int_ref,
)
from paged_serve.kernels.triton.quantized_gemm import BLOCK_K, launch_settings, quantized_gemm

TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.bfloat16: (3e-2, 3e-2),
    torch.float16: (5e-3, 5e-3),
}


def make_weight(k: int, n: int, *, bits: int, group_size: int, zeros, gen: torch.Generator):
    """Random ``(values [K, N], qweight, scales fp32, zeros)``; ``zeros`` is None (symmetric) or
    the dtype of asymmetric zero points. Scales keep each output near unit size."""
    values = torch.randint(0, 1 << bits, (k, n), generator=gen)
    num_groups = 1 if group_size == -1 else k // group_size
    scales = (torch.rand(num_groups, n, generator=gen) + 0.5) / (k**0.5 * (1 << (bits - 1)))
    zero_points = None
    if zeros is not None:
        zero_points = torch.randint(0, 1 << bits, (num_groups, n), generator=gen).to(zeros)
    return values, pack_int_ref(values, bits), scales, zero_points


CASES = [
    # id, M, N, K, bits, group_size, zeros, biased, dtype, scales in x's dtype
    ("w4-g32-sym-decode", 1, 72, 96, 4, 32, None, False, torch.float32, False),
    ("w4-g64-asym-u8-bias", 5, 200, 192, 4, 64, torch.uint8, True, torch.float32, False),
    ("w4-g128-asym-i32", 33, 72, 384, 4, 128, torch.int32, False, torch.float32, False),
    ("w4-per-channel-bias", 5, 72, 160, 4, -1, None, True, torch.float32, False),
    ("w8-g32-asym-bias", 33, 200, 96, 8, 32, torch.uint8, True, torch.float32, False),
    ("w8-g128-sym", 1, 200, 256, 8, 128, None, False, torch.float32, False),
    ("w8-per-channel-asym", 5, 72, 100, 8, -1, torch.int32, False, torch.float32, False),
    ("w4-g128-bf16-bias", 5, 200, 384, 4, 128, torch.uint8, True, torch.bfloat16, True),
    ("w8-g64-bf16-fp32-scales", 33, 72, 192, 8, 64, None, False, torch.bfloat16, False),
    ("w4-g32-fp16-sym", 1, 72, 64, 4, 32, None, True, torch.float16, True),
    ("w4-g64-prefill-300", 300, 72, 128, 4, 64, torch.uint8, True, torch.bfloat16, True),
    ("w8-per-channel-100-rows-bias", 100, 72, 100, 8, -1, torch.uint8, True, torch.float32, False),
]


@pytest.mark.parametrize(
    "m,n,k,bits,group_size,zeros,biased,dtype,act_scales",
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_matches_reference(
    device, m, n, k, bits, group_size, zeros, biased, dtype, act_scales
) -> None:
    gen = torch.Generator().manual_seed(0)
    _, qweight, scales, zero_points = make_weight(
        k, n, bits=bits, group_size=group_size, zeros=zeros, gen=gen
    )
    if act_scales:
        scales = scales.to(dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if biased else None
    quant = dict(bits=bits, group_size=group_size)
    want = quantized_gemm_ref(x, qweight, scales, zero_points, **quant, bias=bias)
    on = {"device": device}
    got = quantized_gemm(
        x.to(**on),
        qweight.to(**on),
        scales.to(**on),
        None if zero_points is None else zero_points.to(**on),
        **quant,
        bias=None if bias is None else bias.to(**on),
    )
    assert got.dtype == dtype and got.shape == (m, n)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize(
    "m,n,k,splits",
    [
        (1, 72, 384, True),
        (5, 200, 100, True),
        (33, 72, 384, True),
        (1, 28672, 4096, False),
        (100, 72, 100, False),
        (300, 4096, 4096, False),
    ],
)
def test_split_k_covers_k_in_whole_steps(m: int, n: int, k: int, splits: bool) -> None:
    launch = launch_settings(m, n, k, 132)
    assert (launch.split_k > 1) == splits
    assert launch.k_per_split % BLOCK_K == 0  # a split starts on a step: one group per step
    assert (launch.split_k - 1) * launch.k_per_split < k <= launch.split_k * launch.k_per_split


def test_split_k_result_is_the_same_bits_each_run(device) -> None:
    x, qweight, scales, zeros = _inputs(device, m=1, n=72, k=384, zeros=torch.uint8)
    assert launch_settings(1, 72, 384, 132).split_k > 1
    first = quantized_gemm(x, qweight, scales, zeros, bits=4, group_size=32)
    assert torch.equal(quantized_gemm(x, qweight, scales, zeros, bits=4, group_size=32), first)


def test_writes_into_out_rows_of_a_wider_buffer(device) -> None:
    gen = torch.Generator().manual_seed(1)
    _, qweight, scales, _ = make_weight(64, 72, bits=4, group_size=32, zeros=None, gen=gen)
    x = torch.randn(3, 64, generator=gen)
    buffer = torch.full((3, 100), float("nan"), device=device)
    out = buffer[:, :72]  # rows contiguous, row stride 100
    got = quantized_gemm(
        x.to(device), qweight.to(device), scales.to(device), bits=4, group_size=32, out=out
    )
    assert got.data_ptr() == out.data_ptr()
    want = quantized_gemm_ref(x, qweight, scales, None, bits=4, group_size=32)
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)
    assert torch.isnan(buffer[:, 72:]).all()  # nothing past the out view is written


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_unpack_round_trip_is_exact(bits: int) -> None:
    gen = torch.Generator().manual_seed(2)
    values = torch.randint(0, 1 << bits, (64, 7), generator=gen)
    values[:8, 0] = (1 << bits) - 1  # a word with its top bit set: a negative int32
    qweight = pack_int_ref(values, bits)
    assert qweight.dtype == torch.int32 and qweight.shape == (64 // (32 // bits), 7)
    assert bool((qweight[0, 0] < 0).item())
    assert torch.equal(unpack_int_ref(qweight, bits), values.to(torch.int32))


def test_packing_is_low_bits_first_along_k() -> None:
    values = torch.arange(8, dtype=torch.int64)[:, None]  # K = 8, N = 1: one word
    assert pack_int_ref(values, 4).item() == 0x76543210
    assert pack_int_ref(torch.tensor([[1], [2], [3], [255]]), 8).item() == 0xFF030201 - (1 << 32)


@pytest.mark.parametrize("group_size", [32, -1])
def test_reference_matches_float64_dequantize_then_matmul(group_size: int) -> None:
    gen = torch.Generator().manual_seed(3)
    k, n, bits = 96, 40, 4
    values, qweight, scales, zeros = make_weight(
        k, n, bits=bits, group_size=group_size, zeros=torch.uint8, gen=gen
    )
    x = torch.randn(6, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    rows = group_size if group_size != -1 else k
    w = torch.empty(n, k, dtype=torch.float64)
    for kk in range(k):  # the plain definition, one input feature at a time
        g = kk // rows
        w[:, kk] = (values[kk].double() - zeros[g].double()) * scales[g].double()
    want = x.double() @ w.t() + bias.double()
    deq = dequantize_ref(qweight, scales, zeros, bits=bits, group_size=group_size)
    assert deq.shape == (n, k) and deq.dtype == torch.float32
    torch.testing.assert_close(deq.double(), w, atol=1e-6, rtol=1e-6)
    got = quantized_gemm_ref(x, qweight, scales, zeros, bits=bits, group_size=group_size, bias=bias)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    symmetric = dequantize_ref(qweight, scales, None, bits=bits, group_size=group_size)
    centred = (values.double() - (1 << (bits - 1))).t() * scales.double().repeat_interleave(
        rows, dim=0
    ).t()
    torch.testing.assert_close(symmetric.double(), centred, atol=1e-6, rtol=1e-6)


def _inputs(device, *, m=4, n=72, k=128, bits=4, group_size=32, zeros=None):
    gen = torch.Generator().manual_seed(4)
    _, qweight, scales, zero_points = make_weight(
        k, n, bits=bits, group_size=group_size, zeros=zeros, gen=gen
    )
    x = torch.randn(m, k, generator=gen)
    on = {"device": device}
    zero_points = None if zero_points is None else zero_points.to(**on)
    return x.to(**on), qweight.to(**on), scales.to(**on), zero_points


def test_rejects_bad_inputs(device) -> None:
    x, qweight, scales, _ = _inputs(device)

    def call(**overrides):
        args = dict(x=x, qweight=qweight, scales=scales, zeros=None, bits=4, group_size=32)
        args.update(overrides)
        return quantized_gemm(
            args["x"],
            args["qweight"],
            args["scales"],
            args["zeros"],
            bits=args["bits"],
            group_size=args["group_size"],
            bias=args.get("bias"),
            out=args.get("out"),
        )

    with pytest.raises(ValueError, match="bits must be one of"):
        call(bits=3)
    with pytest.raises(ValueError, match=f"group_size must be -1 or a multiple of {BLOCK_K}"):
        call(group_size=16)
    with pytest.raises(ValueError, match="dividing K=128, got 96"):
        call(group_size=96, scales=scales[:1])
    with pytest.raises(ValueError, match="qweight has 15 rows of 8 4-bit values; x has K=128"):
        call(qweight=qweight[:15].contiguous())
    with pytest.raises(ValueError, match="qweight must be a contiguous"):
        call(qweight=qweight.float())
    with pytest.raises(ValueError, match=r"scales must be a contiguous \[4, 72\]"):
        call(scales=scales[:2])
    with pytest.raises(ValueError, match="scales must be torch.float32"):
        call(scales=scales.half())
    with pytest.raises(ValueError, match="zeros must be one of"):
        call(zeros=torch.zeros(4, 72, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match=r"zeros must be a contiguous \[4, 72\]"):
        call(zeros=torch.zeros(4, 71, dtype=torch.uint8, device=device))
    with pytest.raises(ValueError, match=r"x must be \[M, K\]"):
        call(x=x.t().contiguous().t())
    with pytest.raises(ValueError, match=r"x must be \[M, K\]"):
        call(x=x.to(torch.int32))
    with pytest.raises(ValueError, match=r"bias must be a contiguous \[72\]"):
        call(bias=torch.zeros(71, device=device))
    with pytest.raises(ValueError, match=r"out must be \[4, 72\]"):
        call(out=torch.empty(4, 72, dtype=torch.bfloat16, device=device))


def test_empty_batch_returns_empty(device) -> None:
    x, qweight, scales, _ = _inputs(device, m=0)
    got = quantized_gemm(x, qweight, scales, bits=4, group_size=32)
    assert got.shape == (0, 72)
