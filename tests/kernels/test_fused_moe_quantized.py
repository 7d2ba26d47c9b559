"""The fused mixture-of-experts kernel over quantized experts (``kernels/triton/quantized_moe.py``)
against ``fused_moe_ref`` over ``dequantize_experts_ref`` (fp32, pair by pair).

The experts are random weights quantized here by plain rounding: 4-bit symmetric and asymmetric
with groups of 32 and 64 inputs and per channel, 8-bit, FP8 e4m3 with block scales (blocks that
do not tile the shapes) and per-channel scales; four experts, top-2, a few tokens, fp32 and bf16
activations, gate/up then down. The reference's dequantization is checked against the weights
that were quantized (within half a quantization step), so the two sides do not share a bug.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from paged_serve.kernels.interface import Fp8Experts, IntExperts
from paged_serve.kernels.reference import dequantize_experts_ref, fused_moe_ref, pack_int_ref
from paged_serve.kernels.triton.fused_moe import align_pairs, fused_moe
from paged_serve.kernels.triton.quantized_moe import quantized_moe_gemm
from tests.kernels.test_fused_moe import _routing, swiglu

TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (3e-2, 3e-2)}
FP8_MAX = 448.0  # e4m3's largest finite value


def quantize_int(
    w: torch.Tensor, *, bits: int, group_size: int, symmetric: bool
) -> tuple[IntExperts, torch.Tensor]:
    """``w [E, N, K]`` as ``IntExperts`` by rounding, and the largest error allowed per weight
    (half a step: ``scale / 2`` broadcast to ``[E, N, K]``)."""
    experts, n, k = w.shape
    g = k if group_size == -1 else group_size
    groups = w.reshape(experts, n, k // g, g)
    top = (1 << bits) - 1
    if symmetric:
        zero = torch.full(groups.shape[:-1], 1 << (bits - 1), dtype=torch.float32)
        scale = groups.abs().amax(-1) / ((1 << (bits - 1)) - 1)
    else:
        low, high = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
        scale = (high - low) / top
        zero = torch.round(-low / scale).clamp(0, top)
    codes = (torch.round(groups / scale[..., None]) + zero[..., None]).clamp(0, top)
    codes = codes.reshape(experts, n, k).to(torch.int32)
    qweight = torch.stack([pack_int_ref(codes[e].t().contiguous(), bits) for e in range(experts)])
    weights = IntExperts(
        qweight=qweight,
        scales=scale.transpose(1, 2).contiguous(),  # [E, G, N]
        zeros=None if symmetric else zero.transpose(1, 2).to(torch.uint8).contiguous(),
        bits=bits,
        group_size=group_size,
    )
    return weights, (scale / 2).repeat_interleave(g, -1)


def quantize_fp8(
    w: torch.Tensor, *, block: tuple[int, int] | None
) -> tuple[Fp8Experts, torch.Tensor]:
    """``w [E, N, K]`` as ``Fp8Experts`` (block or channel scales), and the largest error
    allowed per weight (half of e4m3's spacing at the weight's scaled size: 2^-4 relative)."""
    experts, n, k = w.shape
    if block is None:
        scale = w.abs().amax(-1) / FP8_MAX  # [E, N]
        per_element = scale[:, :, None].expand(-1, -1, k)
    else:
        bn, bk = block
        nb, kb = -(-n // bn), -(-k // bk)
        padded = torch.zeros(experts, nb * bn, kb * bk)
        padded[:, :n, :k] = w.abs()
        scale = padded.view(experts, nb, bn, kb, bk).amax((2, 4)) / FP8_MAX
        per_element = scale.repeat_interleave(bn, 1).repeat_interleave(bk, 2)[:, :n, :k]
    weight = (w / per_element).to(torch.float8_e4m3fn)
    bound = w.abs() * 2.0**-4 + per_element * 2.0**-10  # relative, and the subnormals' spacing
    return Fp8Experts(weight.contiguous(), scale.contiguous(), block), bound


INT_CASES = [
    # id, bits, group_size, symmetric
    ("int4-sym-g32", 4, 32, True),
    ("int4-asym-g64", 4, 64, False),
    ("int4-sym-channel", 4, -1, True),
    ("int4-asym-channel", 4, -1, False),
    ("int8-sym-g32", 8, 32, True),
    ("int8-asym-channel", 8, -1, False),
]
FP8_CASES = [
    ("fp8-block-32x64", (32, 64)),
    ("fp8-block-128x128", (128, 128)),
    ("fp8-channel", None),
]


def _experts(kind: tuple, w: torch.Tensor):
    if kind[0] == "int":
        return quantize_int(w, bits=kind[1], group_size=kind[2], symmetric=kind[3])
    return quantize_fp8(w, block=kind[1])


CASES = [(c[0], ("int", *c[1:])) for c in INT_CASES] + [(c[0], ("fp8", c[1])) for c in FP8_CASES]


def _moe_inputs(kind: tuple, tokens: int, hidden: int, inter: int, seed: int = 0):
    """Input rows, quantized gate/up and down experts (four), and top-2 routing."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w1 = torch.randn(4, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(4, hidden, inter, generator=gen) / inter**0.5
    (q1, bound1), (q2, bound2) = _experts(kind, w1), _experts(kind, w2)
    ids, weights = _routing(tokens, 4, 2, gen)
    return x, (w1, q1, bound1), (w2, q2, bound2), ids, weights


@pytest.mark.parametrize("kind", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_reference_dequantizes_to_the_quantized_weights(kind) -> None:
    _, (w1, q1, bound1), (w2, q2, bound2), _, _ = _moe_inputs(kind, 1, 128, 64)
    for w, q, bound in ((w1, q1, bound1), (w2, q2, bound2)):
        deq = dequantize_experts_ref(q)
        assert deq.shape == w.shape == q.shape
        assert ((deq - w).abs() <= bound * (1 + 1e-5) + 1e-7).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_matches_reference_over_dequantized_experts(device, kind, dtype) -> None:
    # hidden 128 (K of gate/up: groups of 32 and 64 and FP8 block columns of 64 and 128 fit),
    # intermediate 64: the down projection's K; 5 tokens, so some expert gets several pairs
    x, (_, q1, _), (_, q2, _), ids, weights = _moe_inputs(kind, 5, 128, 64, seed=1)
    x = x.to(dtype)
    want = fused_moe_ref(
        x, dequantize_experts_ref(q1), dequantize_experts_ref(q2), ids, weights, apply_gate=swiglu
    )
    got = fused_moe(
        x.to(device),
        _on(q1, device),
        _on(q2, device),
        ids.to(device),
        weights.to(device),
        apply_gate=swiglu,
    )
    assert got.dtype == dtype and got.shape == x.shape
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=atol, rtol=rtol)


def test_fp8_blocks_that_cut_the_shapes(device) -> None:
    """N = 80 and K = 80 rows and columns in blocks of 32 x 64 (both partial at the edge), the
    down projection's K = 40 inside one block column; biases and routing as gpt-oss's."""
    kind = ("fp8", (32, 64))
    x, (_, q1, _), (_, q2, _), ids, weights = _moe_inputs(kind, 3, 80, 40, seed=2)
    gen = torch.Generator().manual_seed(3)
    b1, b2 = torch.randn(4, 80, generator=gen), torch.randn(4, 80, generator=gen)
    d1, d2 = dequantize_experts_ref(q1), dequantize_experts_ref(q2)
    want = fused_moe_ref(x, d1, d2, ids, weights, apply_gate=swiglu, gate_up_bias=b1, down_bias=b2)
    got = fused_moe(
        x.to(device),
        _on(q1, device),
        _on(q2, device),
        ids.to(device),
        weights.to(device),
        apply_gate=swiglu,
        gate_up_bias=b1.to(device),
        down_bias=b2.to(device),
    )
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)


def test_the_engine_stacks_what_the_tiles_read() -> None:
    """engine/quant/experts.py checks group sizes and FP8 block widths against the kernel's K
    step without importing Triton: the two must agree."""
    from paged_serve.engine.quant.experts import KERNEL_BLOCK_K
    from paged_serve.kernels.triton.quantized_moe import BLOCK_K

    assert KERNEL_BLOCK_K == BLOCK_K


def test_refuses_layouts_the_tiles_cannot_read() -> None:
    w = torch.randn(2, 64, 96)
    pairs = align_pairs(torch.tensor([[0, 1]]), 2)
    a = torch.randn(1, 96)
    int4, _ = quantize_int(w, bits=4, group_size=32, symmetric=True)
    with pytest.raises(ValueError, match="group_size must be -1 or a multiple of 32"):
        quantized_moe_gemm(a, replace(int4, group_size=48), pairs, per_token=True)
    with pytest.raises(ValueError, match="bits must be one of"):
        quantized_moe_gemm(a, replace(int4, bits=3), pairs, per_token=True)
    with pytest.raises(ValueError, match="scales must be a contiguous"):
        quantized_moe_gemm(a, replace(int4, scales=int4.scales[:, :1]), pairs, per_token=True)
    with pytest.raises(ValueError, match="a has K=64"):
        quantized_moe_gemm(a[:, :64], int4, pairs, per_token=True)
    fp8, _ = quantize_fp8(w, block=(32, 48))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantized_moe_gemm(a, fp8, pairs, per_token=True)
    fp8, _ = quantize_fp8(w, block=None)
    with pytest.raises(ValueError, match="channel scale must be"):
        quantized_moe_gemm(a, replace(fp8, scale=fp8.scale[:, :8]), pairs, per_token=True)


def _on(weights, device: torch.device):
    """The same experts with their tensors on ``device``."""
    fields = {
        name: getattr(weights, name).to(device)
        for name in weights.__dataclass_fields__
        if isinstance(getattr(weights, name), torch.Tensor)
    }
    return replace(weights, **fields)
