"""Mamba-2's scan kernels (``kernels/triton/ssd_scan.py``) vs ``ssd_scan_ref`` in float64.

Each case is a step of ragged sequences over a pool of state slots: decode rows (the recurrent
kernel), prefill chunks shorter than, equal to and longer than a 32-token chunk of the chunked
kernel (up to three chunks), and mixed steps; fresh sequences (``has_state`` 0, whose slot holds
garbage that must not be read) beside continuing ones; B and C shared by all heads (G = 1) or
by pairs of heads (G = H / 2); head sizes P and N that are not powers of two (P = 40 spans two
P blocks; P = 8, N = 6 are masked up to the dots' 16); with and without the skip D; fp32 and
bf16 inputs; x, B and C views of one projection. The reference runs on the same inputs in
float64, and the states after the step are compared too (slots the step does not name stay
bit-equal). A state carried over four steps through its slot; both reduction orders.
"""

from __future__ import annotations

import pytest
import torch

from paged_serve.kernels.reference import ssd_scan_ref
from paged_serve.kernels.triton.ssd_scan import ssd_scan

DECODE = [1, 1, 1, 1]
PREFILL = [31, 32, 33, 70]
MIXED = [1, 45, 1, 6, 2]
NUM_SLOTS = 7


def _step(lengths: list[int], fresh: set[int], device: torch.device, seed: int):
    """``cu_seqlens``, ``state_slots`` (shuffled), ``has_state`` of a step."""
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    slots = torch.randperm(NUM_SLOTS, generator=gen)[: len(lengths)].to(torch.int32)
    has = torch.tensor([0 if i in fresh else 1 for i in range(len(lengths))], dtype=torch.int32)
    return cu.to(device), slots.to(device), has.to(device)


def _inputs(tokens, heads, groups, p, n, skip, dtype, device, seed=0):
    """x, dt, A, B, C, D, state of a step; x, B and C are views of one projection."""
    gen = torch.Generator().manual_seed(seed)
    xbc = torch.randn(tokens, heads * p + 2 * groups * n, generator=gen).to(dtype)
    x = xbc[:, : heads * p].unflatten(-1, (heads, p))
    B = xbc[:, heads * p : heads * p + groups * n].unflatten(-1, (groups, n))
    C = xbc[:, heads * p + groups * n :].unflatten(-1, (groups, n))
    # Per-token log decays dt * A from near 0 to -4, as trained A_log and dt give.
    dt = torch.rand(tokens, heads, generator=gen) * 0.5 + 0.01
    A = -(1 + torch.rand(heads, generator=gen) * 7)
    D = torch.randn(heads, generator=gen) if skip else None
    state = torch.randn(NUM_SLOTS, heads, p, n, generator=gen) * 0.5
    return [None if t is None else t.to(device) for t in (x, dt, A, B, C, D, state)]


def _reference(x, dt, A, B, C, D, state, meta):
    """The reference in float64 on CPU copies; returns ``(y, state after)``."""
    want_state = state.double().cpu()
    args = (None if t is None else t.double().cpu() for t in (x, dt, A, B, C, D))
    want = ssd_scan_ref(*args, want_state, **{k: v.cpu() for k, v in meta.items()})
    return want, want_state


def _check(lengths, fresh, heads, groups, p, n, skip, dtype, device):
    x, dt, A, B, C, D, state = _inputs(sum(lengths), heads, groups, p, n, skip, dtype, device)
    cu, slots, has = _step(lengths, fresh, device, seed=1)
    meta = dict(cu_seqlens=cu, state_slots=slots, has_state=has)
    want, want_state = _reference(x, dt, A, B, C, D, state, meta)
    got_state = state.clone()
    got = ssd_scan(x, dt, A, B, C, D, got_state, max_seqlen_q=max(lengths), **meta)
    assert got.dtype == dtype and got.shape == x.shape
    atol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.double().cpu(), want, atol=atol, rtol=atol)
    # bf16 steps take TF32 dots on a GPU (exact under the interpreter): 10-bit mantissas.
    state_tol = 2e-5 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(got_state.double().cpu(), want_state, atol=state_tol, rtol=state_tol)
    untouched = sorted(set(range(NUM_SLOTS)) - set(slots.tolist()))
    assert torch.equal(got_state[untouched], state[untouched])


CASES = [
    # id, lengths, fresh sequences, H, G, P, N, D, dtype
    ("decode-recurrent", DECODE, {1}, 4, 2, 24, 20, True, torch.float32),
    ("decode-one-group-no-skip", DECODE, set(), 3, 1, 40, 16, False, torch.float32),
    ("prefill-1-to-3-chunks", PREFILL, {0, 3}, 4, 2, 24, 20, True, torch.float32),
    ("prefill-one-group-no-skip", PREFILL, {2}, 2, 1, 40, 12, False, torch.float32),
    ("mixed", MIXED, {1, 3}, 4, 2, 24, 20, True, torch.float32),
    ("mixed-heads-below-a-dot-tile", MIXED, {2}, 2, 2, 8, 6, True, torch.float32),
    ("mixed-bf16", MIXED, {0}, 4, 2, 32, 32, True, torch.bfloat16),
    ("prefill-bf16", PREFILL, {1}, 4, 2, 24, 20, False, torch.bfloat16),
    ("decode-bf16", DECODE, {3}, 2, 1, 16, 24, False, torch.bfloat16),
]


@pytest.mark.parametrize(
    "lengths,fresh,heads,groups,p,n,skip,dtype",
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_ssd_scan_matches_the_reference(lengths, fresh, heads, groups, p, n, skip, dtype, device):
    _check(lengths, fresh, heads, groups, p, n, skip, dtype, device)


def test_ssd_scan_in_both_reduction_orders(device, interpreter_order):
    _check(MIXED, {1}, 4, 2, 24, 20, True, torch.float32, device)
    _check(DECODE, {0}, 4, 2, 24, 20, True, torch.float32, device)


def test_the_state_carries_across_steps(device):
    """A prefill of 40 tokens, one of 5 and two decode steps, each through the slot, equal
    the reference over all 47 tokens in one step."""
    lengths = [40, 5, 1, 1]
    x, dt, A, B, C, D, state = _inputs(sum(lengths), 4, 2, 24, 20, True, torch.float32, device)
    slot = torch.tensor([3], dtype=torch.int32, device=device)
    whole = dict(
        cu_seqlens=torch.tensor([0, sum(lengths)], dtype=torch.int32, device=device),
        state_slots=slot,
        has_state=torch.zeros(1, dtype=torch.int32, device=device),
    )
    want, want_state = _reference(x, dt, A, B, C, D, state, whole)
    got_state = state.clone()
    outs, a = [], 0
    for i, length in enumerate(lengths):
        meta = dict(
            cu_seqlens=torch.tensor([0, length], dtype=torch.int32, device=device),
            state_slots=slot,
            has_state=torch.full((1,), int(i > 0), dtype=torch.int32, device=device),
        )
        rows = slice(a, a + length)
        outs.append(
            ssd_scan(
                x[rows], dt[rows], A, B[rows], C[rows], D, got_state, max_seqlen_q=length, **meta
            )
        )
        a += length
    torch.testing.assert_close(torch.cat(outs).double().cpu(), want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got_state.double().cpu(), want_state, atol=2e-5, rtol=2e-5)


def test_chunked_kernel_takes_decode_rows_too(device):
    """A decode row inside a prefill step runs the chunked kernel: same as the recurrent one."""
    x, dt, A, B, C, D, state = _inputs(len(DECODE), 4, 2, 24, 20, True, torch.float32, device)
    cu, slots, has = _step(DECODE, {2}, device, seed=1)
    meta = dict(cu_seqlens=cu, state_slots=slots, has_state=has)
    recurrent, chunked = state.clone(), state.clone()
    a = ssd_scan(x, dt, A, B, C, D, recurrent, max_seqlen_q=1, **meta)
    b = ssd_scan(x, dt, A, B, C, D, chunked, max_seqlen_q=2, **meta)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(recurrent, chunked, atol=1e-6, rtol=1e-6)


def test_the_kernel_refuses_what_it_cannot_run(device):
    x, dt, A, B, C, D, state = _inputs(3, 4, 2, 24, 20, True, torch.float32, device)
    cu, slots, has = _step([3], set(), device, seed=1)
    meta = dict(cu_seqlens=cu, state_slots=slots, has_state=has, max_seqlen_q=3)
    with pytest.raises(ValueError, match="state must be fp32"):
        ssd_scan(x, dt, A, B, C, D, state.double(), **meta)
    with pytest.raises(ValueError, match="do not fit"):
        ssd_scan(x[:, :3], dt, A, B, C, D, state, **meta)
    with pytest.raises(ValueError, match="dt must be"):
        ssd_scan(x, dt[:, :2], A, B, C, D, state, **meta)
    with pytest.raises(ValueError, match="D must be"):
        ssd_scan(x, dt, A, B, C, D[:2], state, **meta)
    with pytest.raises(ValueError, match="contiguous last dims"):
        ssd_scan(x.transpose(1, 2).contiguous().transpose(1, 2), dt, A, B, C, D, state, **meta)
