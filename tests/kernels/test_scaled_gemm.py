"""The FP8 and int8 W8A8 GEMM against ``reference.fp8_gemm_ref`` / ``int8_gemm_ref``.

Cases: e4m3 weights with tensor, channel and block scales (128 x 128 and 32 x 32 blocks, N and
K not multiples of the block: N 72 and 200, K 100, 160 and 300), int8 weights with channel
scales; M of 1, 5, 33 and 100 (each row tile); bias or none; fp32, bf16 and fp16 activations.
The activation quantization is compared code for code with the reference's (random rows, rows
of exact rounding ties, an all-zero row); the references are checked once against a float64
computation from the definitions written here (e4m3 values from their bit layout); the
launchers' errors by name; and ``QuantizedLinear(kernel="triton")`` over ``ScaledFp8`` and
``ScaledInt8`` weights against ``F.linear`` over the dequantized weight, within the error the
activations' quantization can make.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paged_serve.engine.quant.linear import QuantizedLinear
from paged_serve.engine.quant.weights import ScaledFp8, ScaledInt8
from paged_serve.kernels.reference import (
    fp8_gemm_ref,
    int8_gemm_ref,
    quantize_fp8_rows_ref,
    quantize_int8_rows_ref,
)
from paged_serve.kernels.triton import scaled_gemm
from paged_serve.kernels.triton.scaled_gemm import (
    fp8_gemm,
    int8_gemm,
    launch_settings,
    quantize_fp8_rows,
    quantize_int8_rows,
)

TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.bfloat16: (1e-2, 1e-2),  # one bf16 ulp at unit size: both round the same fp32 value
    torch.float16: (2e-3, 2e-3),
}


def make_fp8_weight(n: int, k: int, scheme: str, block: tuple[int, int] | None, gen):
    """A random e4m3 ``[N, K]`` weight and its fp32 scale; outputs come out near unit size."""
    weight = (torch.randn(n, k, generator=gen) * 64).to(torch.float8_e4m3fn)
    unit = 1 / (64 * k**0.5)
    if scheme == "tensor":
        scale = torch.tensor(unit)
    elif scheme == "channel":
        scale = (torch.rand(n, generator=gen) + 0.5) * unit
    else:
        bn, bk = block
        scale = (torch.rand(-(-n // bn), -(-k // bk), generator=gen) + 0.5) * unit
    return weight, scale


def make_int8_weight(n: int, k: int, gen):
    weight = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    return weight, (torch.rand(n, generator=gen) + 0.5) / (64 * k**0.5)


FP8_CASES = [
    # id, M, N, K, scheme, block, biased, dtype
    ("tensor-decode", 1, 72, 100, "tensor", None, False, torch.float32),
    ("tensor-bf16-bias", 33, 200, 160, "tensor", None, True, torch.bfloat16),
    ("channel-bias", 5, 200, 100, "channel", None, True, torch.float32),
    ("channel-bf16-100-rows", 100, 72, 160, "channel", None, False, torch.bfloat16),
    ("block32-decode-bias", 1, 72, 100, "block", (32, 32), True, torch.float32),
    ("block32-bf16", 5, 200, 100, "block", (32, 32), False, torch.bfloat16),
    ("block32-33-rows-bias", 33, 72, 160, "block", (32, 32), True, torch.float32),
    ("block128", 5, 200, 300, "block", (128, 128), False, torch.float32),
    ("block128-bf16-100-rows-bias", 100, 200, 300, "block", (128, 128), True, torch.bfloat16),
    ("block128-fp16-decode", 1, 200, 300, "block", (128, 128), True, torch.float16),
]


@pytest.mark.parametrize(
    "m,n,k,scheme,block,biased,dtype", [c[1:] for c in FP8_CASES], ids=[c[0] for c in FP8_CASES]
)
def test_fp8_gemm_matches_reference(device, m, n, k, scheme, block, biased, dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    weight, scale = make_fp8_weight(n, k, scheme, block, gen)
    rows = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if biased else None
    want = fp8_gemm_ref(rows, weight, scale, block_size=block, bias=bias)
    on = {"device": device}
    got = fp8_gemm(
        rows.to(**on),
        weight.to(**on),
        scale.to(**on),
        block_size=block,
        bias=None if bias is None else bias.to(**on),
    )
    assert got.dtype == dtype and got.shape == (m, n)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=atol, rtol=rtol)


INT8_CASES = [
    # id, M, N, K, biased, dtype
    ("decode", 1, 72, 100, False, torch.float32),
    ("bias", 5, 200, 160, True, torch.float32),
    ("bf16-33-rows", 33, 72, 300, True, torch.bfloat16),
    ("100-rows", 100, 200, 100, False, torch.float32),
]


@pytest.mark.parametrize(
    "m,n,k,biased,dtype", [c[1:] for c in INT8_CASES], ids=[c[0] for c in INT8_CASES]
)
def test_int8_gemm_matches_reference(device, m, n, k, biased, dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    weight, scale = make_int8_weight(n, k, gen)
    rows = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if biased else None
    want = int8_gemm_ref(rows, weight, scale, bias=bias)
    on = {"device": device}
    got = int8_gemm(
        rows.to(**on),
        weight.to(**on),
        scale.to(**on),
        bias=None if bias is None else bias.to(**on),
    )
    assert got.dtype == dtype and got.shape == (m, n)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=atol, rtol=rtol)


def _assert_same_quantization(got, want) -> None:
    """The kernel's codes are the reference's bits (it divides as IEEE does and rounds to
    nearest even, as torch's cast and ``torch.round`` do), its scales equal to 1e-6."""
    (codes, scales), (want_codes, want_scales) = got, want
    assert codes.dtype == want_codes.dtype and codes.shape == want_codes.shape
    as_int = torch.uint8 if codes.dtype == torch.float8_e4m3fn else torch.int8
    assert torch.equal(codes.cpu().view(as_int), want_codes.view(as_int))
    torch.testing.assert_close(scales.cpu(), want_scales, atol=0, rtol=1e-6)


@pytest.mark.parametrize("group_size", [None, 32, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_activation_codes_match_reference(device, group_size, dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    rows = (torch.randn(7, 300, generator=gen) * torch.logspace(-3, 2, 7)[:, None]).to(dtype)
    rows[3] = 0.0  # all zero: the floored scale, zero codes
    got = quantize_fp8_rows(rows.to(device), group_size=group_size)
    want = quantize_fp8_rows_ref(rows, group_size=group_size)
    groups = 1 if group_size is None else -(-300 // group_size)
    assert want[1].shape == (7, groups)
    _assert_same_quantization(got, want)
    assert not bool(want[0][3].float().any())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_activation_codes_match_reference(device, dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    rows = (torch.randn(6, 300, generator=gen) * torch.logspace(-3, 2, 6)[:, None]).to(dtype)
    rows[2] = 0.0
    _assert_same_quantization(quantize_int8_rows(rows.to(device)), quantize_int8_rows_ref(rows))


def e4m3_values() -> torch.Tensor:
    """The 127 finite non-negative e4m3fn values from the bit layout (1 sign, 4 exponent bits
    biased by 7, 3 fraction bits; exponent 0 subnormal), in float64; index = code."""
    values = [m / 8 * 2.0**-6 for m in range(8)]
    values += [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8)]
    return torch.tensor(values[:-1], dtype=torch.float64)  # 0x7F is NaN


def test_fp8_rounding_ties_go_to_even_codes(device) -> None:
    """Scale 1 (the row's amax is 448): each midpoint between neighbouring e4m3 values, either
    sign, becomes the neighbour with an even code, subnormals included."""
    table = e4m3_values()
    mids = (table[:-1] + table[1:]) / 2
    row = torch.cat([mids, -mids, table[-1:]]).float()  # exact in fp32
    codes, scales = quantize_fp8_rows(row[None].to(device))
    assert scales.item() == 1.0
    even = torch.arange(1, len(table)) // 2 * 2  # the even of codes i - 1, i
    got = codes.cpu().view(torch.uint8)[0].to(torch.int64)
    assert torch.equal(got[: len(mids)], even)
    assert torch.equal(got[len(mids) : 2 * len(mids)], even | 0x80)  # the sign bit
    assert got[-1].item() == 0x7E  # 448


def test_int8_rounding_ties_go_to_even(device) -> None:
    halves = torch.arange(-127, 127, dtype=torch.float32) + 0.5
    row = torch.cat([halves, torch.tensor([127.0])])
    codes, scales = quantize_int8_rows(row[None].to(device))
    assert scales.item() == 1.0
    want = torch.where(halves.floor() % 2 == 0, halves.floor(), halves.ceil())
    assert torch.equal(codes.cpu()[0, :-1].float(), want)


def round_to_e4m3_float64(y: torch.Tensor) -> torch.Tensor:
    """Nearest e4m3 value of each ``|y| <= 448``, ties to the even code, from the table."""
    table = e4m3_values()
    mag = y.abs()
    hi = torch.searchsorted(table, mag).clamp(max=len(table) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = mag - table[lo], table[hi] - mag
    pick = torch.where(
        d_lo < d_hi, lo, torch.where(d_hi < d_lo, hi, torch.where(lo % 2 == 0, lo, hi))
    )
    return torch.sign(y) * table[pick]


def _quantized_float64(x: torch.Tensor, group: int, qmax: float, rounding) -> torch.Tensor:
    """``x`` quantized per row and ``group`` inputs and dequantized, in float64."""
    out = torch.empty_like(x, dtype=torch.float64)
    for start in range(0, x.shape[1], group):
        part = x[:, start : start + group].double()
        amax = part.abs().amax(dim=1, keepdim=True).clamp_min(1e-10)
        scale = (amax / qmax).float().double()  # the scale is stored in fp32
        out[:, start : start + group] = rounding((part / scale).clamp(-qmax, qmax)) * scale
    return out


@pytest.mark.parametrize(
    "scheme,block", [("tensor", None), ("channel", None), ("block", (32, 32)), ("block", (16, 64))]
)
def test_fp8_reference_matches_float64_definition(scheme, block) -> None:
    gen = torch.Generator().manual_seed(4)
    n, k = 72, 100
    weight, scale = make_fp8_weight(n, k, scheme, block, gen)
    rows = torch.randn(6, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    group = k if block is None else block[1]
    a = _quantized_float64(rows, group, 448.0, round_to_e4m3_float64)
    w = torch.empty(n, k, dtype=torch.float64)
    for nn in range(n):  # the plain definition, one weight at a time
        for kk in range(k):
            if scheme == "tensor":
                s = scale
            elif scheme == "channel":
                s = scale[nn]
            else:
                s = scale[nn // block[0], kk // block[1]]
            w[nn, kk] = weight[nn, kk].double() * s.double()
    want = a @ w.t() + bias.double()
    got = fp8_gemm_ref(rows, weight, scale, block_size=block, bias=bias)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_int8_reference_matches_float64_definition() -> None:
    gen = torch.Generator().manual_seed(5)
    n, k = 72, 100
    weight, scale = make_int8_weight(n, k, gen)
    rows = torch.randn(6, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    a = _quantized_float64(rows, k, 127.0, torch.round)  # torch.round: ties to even
    want = a @ (weight.double() * scale.double()[:, None]).t() + bias.double()
    got = int8_gemm_ref(rows, weight, scale, bias=bias)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("m,block_k", [(1, None), (16, (128, 128)), (17, (32, 96)), (65, (1, 64))])
def test_launch_k_step_lies_in_one_group(m: int, block_k) -> None:
    group_k = None if block_k is None else block_k[1]
    launch = launch_settings(m, group_k=group_k)
    assert launch.block_k in (32, 64, 128)
    if group_k is not None:
        assert group_k % launch.block_k == 0
    assert launch.block_m >= min(m, 16) and launch.block_m in (16, 64, 128)


def test_rejects_bad_inputs(device) -> None:
    gen = torch.Generator().manual_seed(6)
    weight, scale = make_fp8_weight(72, 100, "block", (32, 32), gen)
    on = {"device": device}
    rows, weight, scale = torch.randn(4, 100, **on), weight.to(**on), scale.to(**on)
    with pytest.raises(
        ValueError, match=r"weight must be a contiguous \[N, K\] torch.float8_e4m3fn"
    ):
        fp8_gemm(rows, weight.to(torch.bfloat16), scale, block_size=(32, 32))
    with pytest.raises(ValueError, match="weight has K=96 inputs; rows have K=100"):
        fp8_gemm(rows, weight[:, :96].contiguous(), scale, block_size=(32, 32))
    with pytest.raises(ValueError, match=r"scale must be a contiguous \[3, 4\] for block_size"):
        fp8_gemm(rows, weight, scale[:, :3].contiguous(), block_size=(32, 32))
    with pytest.raises(ValueError, match=r"scale must be \[\] or \[1\] \(per tensor\) or \[72\]"):
        fp8_gemm(rows, weight, scale, block_size=None)
    with pytest.raises(ValueError, match="bk a positive multiple of 32, got \\(32, 48\\)"):
        fp8_gemm(rows, weight, scale, block_size=(32, 48))
    with pytest.raises(ValueError, match="scale must be torch.float32"):
        fp8_gemm(rows, weight, scale.double(), block_size=(32, 32))
    with pytest.raises(ValueError, match=r"rows must be \[M, K\]"):
        fp8_gemm(rows.to(torch.int32), weight, scale, block_size=(32, 32))
    with pytest.raises(ValueError, match=r"bias must be a contiguous \[72\]"):
        fp8_gemm(rows, weight, scale, block_size=(32, 32), bias=torch.zeros(71, **on))
    int8_weight, int8_scale = (t.to(**on) for t in make_int8_weight(72, 100, gen))
    with pytest.raises(ValueError, match=r"weight must be a contiguous \[N, K\] torch.int8"):
        int8_gemm(rows, weight, int8_scale)
    with pytest.raises(ValueError, match=r"scale must be a contiguous \[72\] \(per channel\)"):
        int8_gemm(rows, int8_weight, int8_scale[:1].contiguous())


def test_refuses_gpus_without_8_bit_tensor_cores(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    with pytest.raises(ValueError, match="fp8_gemm .* needs a GPU of compute capability 8.9"):
        scaled_gemm._check_capability(torch.device("cuda"), (8, 9), "fp8_gemm (e4m3 tensor cores)")
    scaled_gemm._check_capability(torch.device("cuda"), (8, 0), "int8_gemm")  # 8.6 has int8


def test_empty_batch_returns_empty(device) -> None:
    gen = torch.Generator().manual_seed(7)
    weight, scale = make_fp8_weight(72, 100, "channel", None, gen)
    got = fp8_gemm(
        torch.empty(0, 100, device=device), weight.to(device), scale.to(device), block_size=None
    )
    assert got.shape == (0, 72)


def _quantization_bound(
    x: torch.Tensor, weight: torch.Tensor, *, group: int, fp8: bool
) -> torch.Tensor:
    """``[M, N]``: the most ``|dq(quant(x)) @ W^T - x @ W^T|`` can be. Per input, rounding to
    int8 moves ``x`` by at most half a step, ``s / 2``; rounding to e4m3 by at most half an ulp,
    ``2^-4 |x|`` for normal values and ``2^-10 s`` among the subnormals (``s`` the group's
    scale). Summed against ``|W|``."""
    x = x.double()
    per_input = torch.empty_like(x)
    for start in range(0, x.shape[1], group):
        part = x[:, start : start + group]
        s = part.abs().amax(dim=1, keepdim=True) / (448.0 if fp8 else 127.0)
        err = 2.0**-4 * part.abs() + 2.0**-10 * s if fp8 else (s / 2).expand_as(part)
        per_input[:, start : start + group] = err
    return per_input @ weight.double().abs().t()


@pytest.mark.parametrize("layout", ["fp8-block", "fp8-channel", "int8"])
def test_quantized_linear_on_triton_runs_the_w8a8_gemm(device, layout) -> None:
    """``QuantizedLinear(kernel="triton")`` gives the W8A8 GEMM's product: the reference's, and
    within :func:`_quantization_bound` (+ 1e-5 for fp32 rounding) of the exact ``F.linear``
    over the dequantized weight."""
    gen = torch.Generator().manual_seed(8)
    n, k = 72, 100
    if layout == "int8":
        weight = ScaledInt8(*make_int8_weight(n, k, gen))
        group, block = k, None
    else:
        block = (32, 32) if layout == "fp8-block" else None
        weight = ScaledFp8(*make_fp8_weight(n, k, layout[4:], block, gen), block)
        group = k if block is None else block[1]
    bias = torch.randn(n, generator=gen)
    x = torch.randn(2, 3, k, generator=gen)
    module = QuantizedLinear(weight, bias).to(device)
    module.kernel = "triton"
    got = module(x.to(device)).cpu()
    assert got.shape == (2, 3, n)
    rows = x.reshape(6, k)
    if layout == "int8":
        want = int8_gemm_ref(rows, weight.weight, weight.scale, bias=bias)
    else:
        want = fp8_gemm_ref(rows, weight.weight, weight.scale, block_size=block, bias=bias)
    torch.testing.assert_close(got.reshape(6, n), want, atol=2e-5, rtol=2e-5)
    dequantized = weight.dequantize()
    exact = F.linear(rows.double(), dequantized.double(), bias.double())
    bound = _quantization_bound(rows, dequantized, group=group, fp8=layout != "int8")
    error = (got.reshape(6, n).double() - exact).abs()
    assert bool((error <= bound + 1e-5).all()), (error - bound).max()
    assert error.max() > 1e-4  # the activations were quantized: not the dequantize path
