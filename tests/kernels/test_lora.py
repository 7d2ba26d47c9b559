"""Batched multi-LoRA shrink and expand against a per-adapter matmul loop in float64.

The oracle (:func:`oracle`) takes, for each slot, the tokens using it and multiplies them by that
adapter's A, then B, in float64 from the same (already rounded) inputs the kernels read. So the
only errors left to tolerate are the kernels' own: fp32 accumulation, and for expand the one
rounding of the result to y's dtype. Cases: ranks 1, 8, 16, 64, a fused 3 * 16 and 3 * 64 (several
rank tiles); 1, 4 and 16 adapter slots; K (100, 300) and N (72, 200) not multiples of the tiles;
tokens without an adapter (-1) among the others; fp32, bf16 and fp16; x, y and s with row strides
wider than their rows; both reduction orders (``interpreter_order``). Every comparison is also
made against the oracle with the tokens' slots shifted, which must fail: the adapters differ and
the tolerances are tight enough to see a wrong slot. The references are checked against the
same oracle, and the launchers' errors by name.
"""

from __future__ import annotations

import pytest
import torch

from paged_serve.kernels.reference import lora_expand_ref, lora_shrink_ref
from paged_serve.kernels.triton.lora import launch_settings, lora_expand, lora_shrink

# Shrink returns fp32 whatever x's dtype, from x's and a's values exactly: its only error is the
# fp32 sum of K products, about sqrt(K) * 2^-24 * |s| (K <= 300, |s| ~ 1: ~1e-6), so 1e-5.
SHRINK_TOL = dict(atol=1e-5, rtol=1e-5)
# Expand's fp32 sum (R <= 192 terms, same argument) plus one rounding of y + delta to y's dtype:
# at most half an ulp on a GPU (round to nearest), 2^-11 of the value in fp16, none in fp32. In
# bf16 a whole ulp, 2^-7: Triton's interpreter casts fp32 to bf16 by truncation (its cast_impl
# passes no rounding mode), so under TRITON_INTERPRET=1 the error reaches one ulp.
EXPAND_TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=1e-5, rtol=2**-7),
    torch.float16: dict(atol=1e-5, rtol=2**-11),
}

CASES = [
    # id, tokens, K, N, rank, slots, dtype
    ("r1-one-adapter-fp32", 5, 100, 72, 1, 1, torch.float32),
    ("r8-4-adapters-bf16", 7, 100, 72, 8, 4, torch.bfloat16),
    ("r16-16-adapters-fp32", 9, 300, 200, 16, 16, torch.float32),
    ("r16-4-adapters-fp16", 6, 300, 72, 16, 4, torch.float16),
    ("r64-4-adapters-bf16", 6, 300, 200, 64, 4, torch.bfloat16),
    ("fused-3x16-16-adapters-bf16", 8, 100, 72, 48, 16, torch.bfloat16),
    ("fused-3x64-4-adapters-fp32", 5, 100, 200, 192, 4, torch.float32),
]
PARAMS = pytest.mark.parametrize(
    "tokens,k,n,rank,num_slots,dtype", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)


def make_slots(tokens: int, num_slots: int, gen: torch.Generator) -> torch.Tensor:
    """``[T]`` int32 slots in ``[-1, S)``: random, with at least two -1 tokens, the last slot
    used, and two neighbouring tokens sharing a slot (as a prompt's tokens do)."""
    slots = torch.randint(-1, num_slots, (tokens,), generator=gen)
    slots[0], slots[1], slots[2] = num_slots - 1, -1, num_slots - 1
    slots[-1] = -1
    return slots.to(torch.int32)


def make_adapters(num_slots: int, rank: int, k: int, n: int, dtype, gen: torch.Generator):
    """``(a [S, R, K], b [S, R, N])`` in ``dtype``, sized like trained adapters (|s| and the
    update ~1). Each is a contiguous view one slot past the start of a buffer whose first slot
    is NaN: a kernel that read slot -1 (one slot before) would turn its output NaN."""
    a = torch.randn(num_slots + 1, rank, k, generator=gen) / k**0.5
    b = torch.randn(num_slots + 1, rank, n, generator=gen) / rank**0.5
    a[0], b[0] = float("nan"), float("nan")
    return a.to(dtype)[1:], b.to(dtype)[1:]


def oracle(x, a, b, slots, y) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, y + s @ B)`` in float64, adapter by adapter: for each slot, its tokens' rows."""
    s = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float64)
    out = y.double().clone()
    for slot in range(a.shape[0]):
        rows = slots == slot
        s[rows] = x[rows].double() @ a[slot].double().t()
        out[rows] += s[rows] @ b[slot].double()
    return s, out


def shifted(slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Each adapter token's slot replaced by the next one (with one slot: by no adapter)."""
    wrong = (slots + 1) % num_slots if num_slots > 1 else torch.full_like(slots, -1)
    return torch.where(slots >= 0, wrong, slots)


def assert_wrong_slots_fail(got, x, a, b, slots, y, *, expand: bool, tol: dict) -> None:
    """``got`` must not also match the oracle of shifted slots: the test could fail."""
    want_wrong = oracle(x, a, b, shifted(slots, a.shape[0]), y)[1 if expand else 0]
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got.double(), want_wrong, **tol)


def strided_rows(rows: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(view, buffer)``: ``rows`` copied into the middle columns of a wider buffer of random
    values, the view's row stride ``cols + 2 * pad``."""
    t, cols = rows.shape
    gen = torch.Generator().manual_seed(cols)
    wide = torch.randn(t, cols + 2 * pad, generator=gen).to(rows.dtype).to(rows.device)
    view = wide[:, pad : pad + cols]
    view.copy_(rows)
    return view, wide


def make_case(tokens, k, n, rank, num_slots, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, _ = strided_rows(torch.randn(tokens, k, generator=gen).to(dtype), pad=3)
    a, b = make_adapters(num_slots, rank, k, n, dtype, gen)
    y = torch.randn(tokens, n, generator=gen).to(dtype)
    slots = make_slots(tokens, num_slots, gen)
    on = dict(device=device)
    return x.to(**on), a.to(**on), b.to(**on), slots.to(**on), y.to(**on)


def test_cases_cover_several_tiles_and_both_early_paths() -> None:
    """The table reaches the loops' second steps and the grids' second tiles."""
    assert any(c[2] > launch_settings(c[4]).block_k for c in CASES)  # shrink: several K steps
    assert any(c[4] > launch_settings(c[4]).block_r for c in CASES)  # several rank tiles
    assert any(c[3] > launch_settings(c[4]).block_n for c in CASES)  # expand: several N tiles
    assert {1, 4, 16} <= {c[5] for c in CASES}


@PARAMS
def test_shrink_matches_per_adapter_matmul(
    device, interpreter_order, tokens, k, n, rank, num_slots, dtype
) -> None:
    x, a, b, slots, y = make_case(tokens, k, n, rank, num_slots, dtype, device)
    assert x.stride(0) > k
    got = lora_shrink(x, a, slots).cpu()
    assert got.dtype == torch.float32 and got.shape == (tokens, rank)
    x, a, b, slots, y = (t.cpu() for t in (x, a, b, slots, y))
    want = oracle(x, a, b, slots, y)[0]
    torch.testing.assert_close(got.double(), want, **SHRINK_TOL)
    assert torch.equal(got[slots < 0], torch.zeros(int((slots < 0).sum()), rank))
    assert_wrong_slots_fail(got, x, a, b, slots, y, expand=False, tol=SHRINK_TOL)


@PARAMS
def test_expand_matches_per_adapter_matmul(
    device, interpreter_order, tokens, k, n, rank, num_slots, dtype
) -> None:
    x, a, b, slots, y = make_case(tokens, k, n, rank, num_slots, dtype, device)
    # expand on its own: s in fp32 from the oracle, y a column slice of a wider tensor
    s = oracle(*(t.cpu() for t in (x, a, b, slots, y)))[0].float().to(device)
    y_view, wide = strided_rows(y, pad=5)
    wide_before = wide.clone()
    lora_expand(s, b, slots, y_view)
    got, wide = y_view.cpu(), wide.cpu()
    x, a, b, slots, y, s = (t.cpu() for t in (x, a, b, slots, y, s))
    want = y.double().clone()
    for slot in range(num_slots):  # the oracle's second half, from the same fp32 s
        rows = slots == slot
        want[rows] += s[rows].double() @ b[slot].double()
    tol = EXPAND_TOL[dtype]
    torch.testing.assert_close(got.double(), want, **tol)
    assert torch.equal(got[slots < 0], y[slots < 0])  # no adapter: bit for bit
    assert torch.equal(wide[:, :5], wide_before[:, :5].cpu())  # nothing outside the view
    assert torch.equal(wide[:, 5 + n :], wide_before[:, 5 + n :].cpu())
    assert_wrong_slots_fail(got, x, a, b, slots, y, expand=True, tol=tol)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).removeprefix("torch.")
)
def test_shrink_then_expand_is_the_adapter_update(device, interpreter_order, dtype) -> None:
    """Chained as a layer runs them, into a strided ``out`` (a graph's static buffer)."""
    x, a, b, slots, y = make_case(7, 100, 72, 48, 4, dtype, device, seed=3)
    buffer = torch.full((7, 64), float("nan"), device=device)
    s = lora_shrink(x, a, slots, out=buffer[:, :48])
    assert s.data_ptr() == buffer.data_ptr()
    assert torch.isnan(buffer[:, 48:]).all()
    assert torch.equal(s[slots < 0].cpu(), torch.zeros(int((slots < 0).sum()), 48))  # written
    y_before = y.clone()
    lora_expand(s, b, slots, y)
    want = oracle(*(t.cpu() for t in (x, a, b, slots, y_before)))[1]
    # s rounded to fp32 before expand: relative 2^-24 on top of expand's own tolerance
    torch.testing.assert_close(y.cpu().double(), want, **EXPAND_TOL[dtype])


def test_every_token_without_an_adapter(device) -> None:
    x, a, b, _, y = make_case(4, 100, 72, 16, 4, torch.bfloat16, device)
    slots = torch.full((4,), -1, dtype=torch.int32, device=device)
    s = lora_shrink(x, a, slots)
    assert torch.equal(s.cpu(), torch.zeros(4, 16))
    y_before = y.clone()
    lora_expand(torch.full_like(s, float("nan")), b, slots, y)  # s is not even read
    assert torch.equal(y, y_before)


@PARAMS
def test_references_match_per_adapter_matmul(tokens, k, n, rank, num_slots, dtype) -> None:
    x, a, b, slots, y = make_case(tokens, k, n, rank, num_slots, dtype, torch.device("cpu"))
    want_s, want_y = oracle(x, a, b, slots, y)
    s = lora_shrink_ref(x, a, slots)
    torch.testing.assert_close(s.double(), want_s, **SHRINK_TOL)
    assert_wrong_slots_fail(s, x, a, b, slots, y, expand=False, tol=SHRINK_TOL)
    got = y.clone()
    lora_expand_ref(s, b, slots, got)
    torch.testing.assert_close(got.double(), want_y, **EXPAND_TOL[dtype])
    assert torch.equal(got[slots < 0], y[slots < 0])
    assert_wrong_slots_fail(got, x, a, b, slots, y, expand=True, tol=EXPAND_TOL[dtype])


def test_launchers_reject_bad_inputs(device) -> None:
    x, a, b, slots, y = make_case(5, 100, 72, 8, 4, torch.float32, device)
    s = lora_shrink(x, a, slots)
    with pytest.raises(ValueError, match="token_slots"):
        lora_shrink(x, a, slots.long())
    with pytest.raises(ValueError, match="token_slots"):
        lora_expand(s, b, slots[:4], y)
    with pytest.raises(ValueError, match="a must be"):
        lora_shrink(x, a.to(torch.bfloat16), slots)
    with pytest.raises(ValueError, match="K=99"):
        lora_shrink(x[:, :99], a, slots)
    with pytest.raises(ValueError, match="x must be"):
        lora_shrink(x.t(), a, slots)
    with pytest.raises(ValueError, match="b must be"):
        lora_expand(s, b.transpose(1, 2), slots, y)
    with pytest.raises(ValueError, match="s must be"):
        lora_expand(s[:, :4], b, slots, y)
    with pytest.raises(ValueError, match="N=71"):
        lora_expand(s, b, slots, y[:, :71])
