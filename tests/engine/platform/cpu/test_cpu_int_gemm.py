"""The CPU integer GEMM (kernels/cpu/int_gemm.py) against the float64 product of the dequantized
weight: 4 and 8 bits, groups of 32, 64, 128 and one over K, symmetric and with zeros, widths
that are not a multiple of the tile, 1 to 16 rows (and past the register chunk), bias or none,
bf16 inputs, strided inputs; the tiles' round trip; its refusals; and the build failing."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from paged_serve.kernels.cpu import int_gemm
from paged_serve.kernels.cpu.int_gemm import CpuIntGemm, repack, unpack_tiles
from paged_serve.kernels.reference import pack_int_ref

# fp32 accumulation over K inputs: each output is within a few units of fp32's rounding of the
# sum of its terms' magnitudes. The kernel sums x*q and x*zero separately (the zero is applied
# once per group), so the magnitudes are those of q and zero, not of q - zero.
RTOL_OF_MAGNITUDE = 1e-5


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> CpuIntGemm:
    built = int_gemm.load(tmp_path_factory.mktemp("native"))
    assert built is not None, "the C kernel did not build (gcc is on every supported machine)"
    return built


def _weight(n: int, k: int, *, bits: int, group_size: int, symmetric: bool, seed: int = 0):
    """(codes [K, N], scales [G, N], zeros [G, N] uint8 or None) at random."""
    gen = torch.Generator().manual_seed(seed)
    groups = 1 if group_size == -1 else k // group_size
    codes = torch.randint(0, 1 << bits, (k, n), generator=gen)
    scales = torch.rand(groups, n, generator=gen) * 0.02 + 0.001
    zeros = None
    if not symmetric:
        zeros = torch.randint(0, 1 << bits, (groups, n), generator=gen).to(torch.uint8)
    return codes, scales, zeros


def _expanded(codes, scales, zeros, bits, group_size):
    """(w [N, K] float64, |q| + |zero| times scale [N, K]: the magnitudes the kernel sums)."""
    k = codes.shape[0]
    group = torch.arange(k) // (k if group_size == -1 else group_size)
    zero = torch.full_like(codes, 1 << (bits - 1)) if zeros is None else zeros.long()[group]
    scale = scales.double()[group]
    return ((codes - zero) * scale).t(), ((codes + zero) * scale).t()


def _check(kernel, x, codes, scales, zeros, bits, group_size, bias):
    tiled = repack(pack_int_ref(codes, bits), scales, zeros, bits=bits, group_size=group_size)
    y = kernel.matmul(x, tiled, bias=bias)
    w, magnitude = _expanded(codes, scales, zeros, bits, group_size)
    xd = x.double()
    expected = xd @ w.t() + (0 if bias is None else bias.double())
    bound = RTOL_OF_MAGNITUDE * (xd.abs() @ magnitude.t()) + 1e-7
    assert y.dtype == torch.float32 and y.shape == expected.shape
    error = (y.double() - expected).abs()
    assert (error <= bound).all(), f"worst error / bound {float((error / bound).max()):.3g}"


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "zeros"])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_equals_the_float64_product(kernel, bits, group_size, symmetric, rows):
    n, k = 44, 256  # 44 outputs: two full tiles of 16 and a part
    codes, scales, zeros = _weight(n, k, bits=bits, group_size=group_size, symmetric=symmetric)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(n) if rows == 3 else None
    _check(kernel, x, codes, scales, zeros, bits, group_size, bias)


@pytest.mark.parametrize("n", [1, 7, 15, 16, 17, 300])
@pytest.mark.parametrize("rows", [2, 9, 40])  # 9, 40: past the 4 rows a register chunk holds
def test_weird_widths_and_row_counts(kernel, n, rows):
    codes, scales, zeros = _weight(n, 192, bits=4, group_size=64, symmetric=False, seed=n)
    x = torch.randn(rows, 192)
    _check(kernel, x, codes, scales, zeros, 4, 64, torch.randn(n))


def test_bf16_and_strided_inputs_are_widened_and_read_in_place(kernel):
    codes, scales, zeros = _weight(24, 128, bits=8, group_size=32, symmetric=True)
    tiled = repack(pack_int_ref(codes, 8), scales, zeros, bits=8, group_size=32)
    wide = torch.randn(4, 256)
    strided = wide[:, ::2]
    assert not strided.is_contiguous()
    assert torch.equal(kernel.matmul(strided, tiled), kernel.matmul(strided.contiguous(), tiled))
    rows = wide[:, :128]  # rows 256 apart: read in place
    _check(kernel, rows, codes, scales, zeros, 8, 32, None)
    half = torch.randn(3, 128).bfloat16()
    assert torch.equal(kernel.matmul(half, tiled), kernel.matmul(half.float(), tiled))


@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, -1), (8, 64)])
@pytest.mark.parametrize("n", [5, 16, 37])
def test_the_tiles_give_back_the_packed_tensors_exactly(bits, group_size, n):
    codes, scales, zeros = _weight(n, 128, bits=bits, group_size=group_size, symmetric=False)
    qweight = pack_int_ref(codes, bits)
    for z in (zeros, None):
        tiled = repack(qweight, scales, z, bits=bits, group_size=group_size)
        assert tiled.tiles.shape == (-(-n // int_gemm.LANES), qweight.shape[0], int_gemm.LANES)
        back_q, back_s, back_z = unpack_tiles(tiled)
        assert torch.equal(back_q, qweight) and torch.equal(back_s, scales)
        assert (back_z is None) == (z is None) and (z is None or torch.equal(back_z, z))


def test_layouts_it_cannot_read_are_refused(kernel):
    codes, scales, _ = _weight(16, 64, bits=4, group_size=32, symmetric=True)
    qweight = pack_int_ref(codes, 4)
    with pytest.raises(ValueError, match="bits=2"):
        repack(qweight, scales, None, bits=2, group_size=32)
    with pytest.raises(ValueError, match="group_size=48"):
        repack(qweight, scales, None, bits=4, group_size=48)
    with pytest.raises(ValueError, match="do not match"):
        repack(qweight, scales[:, :8], None, bits=4, group_size=32)
    tiled = repack(qweight, scales, None, bits=4, group_size=32)
    with pytest.raises(ValueError, match=r"expected \[M, 64\]"):
        kernel.matmul(torch.randn(2, 32), tiled)
    with pytest.raises(ValueError, match="float16"):
        kernel.matmul(torch.randn(2, 64).half(), tiled)
    with pytest.raises(ValueError, match="bias"):
        kernel.matmul(torch.randn(2, 64), tiled, bias=torch.randn(8))


def test_a_failed_build_says_why_and_returns_none(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(int_gemm, "_loaded", {})
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails
    with caplog.at_level(logging.WARNING):
        assert int_gemm.load(tmp_path) is None
    assert "CPU integer GEMM kernel unavailable" in caplog.text and "false failed" in caplog.text
    assert list((tmp_path / "native").glob("*")) == []


def test_the_build_is_cached(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(int_gemm, "_loaded", {})
    first = int_gemm.load(tmp_path)
    built = list((tmp_path / "native").glob("cpu_int_gemm-*.so"))
    assert first is not None and len(built) == 1
    assert int_gemm.load(tmp_path) is first
