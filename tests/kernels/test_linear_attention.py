"""Gated DeltaNet kernels (causal convolution, gated delta rule) vs their references in float64.

Each case is a step of ragged sequences over a pool of state slots: decode rows (the recurrent
kernel), prefill chunks shorter than, equal to and longer than a 32-token chunk of the chunked
kernel (up to three chunks), and mixed steps; fresh sequences (``has_state`` 0, whose slot holds
garbage that must not be read) beside continuing ones; key heads shared by 1, 2 and 4 value
heads; head sizes that are not powers of two; fp32 and bf16 inputs. The references run on the
same inputs in float64, and the states after the step are compared too. Both reduction orders.
"""

from __future__ import annotations

import pytest
import torch

from paged_serve.kernels.reference import causal_conv1d_ref, gated_delta_rule_ref
from paged_serve.kernels.triton.causal_conv import causal_conv1d
from paged_serve.kernels.triton.delta_rule import gated_delta_rule

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


def _delta_inputs(lengths, heads_k, heads_v, dk, dv, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    qkv = randn(tokens, 2 * heads_k * dk + heads_v * dv).to(dtype)  # views of one projection
    q = qkv[:, : heads_k * dk].unflatten(-1, (heads_k, dk))
    k = qkv[:, heads_k * dk : 2 * heads_k * dk].unflatten(-1, (heads_k, dk))
    v = qkv[:, 2 * heads_k * dk :].unflatten(-1, (heads_v, dv))
    # Decays from near 1 to strong (exp(-4) per token), as trained models' A_log and dt give.
    g = -((torch.rand(tokens, heads_v, generator=gen) * 4) ** 2) / 4
    beta = torch.rand(tokens, heads_v, generator=gen)
    state = randn(NUM_SLOTS, heads_v, dk, dv) * 0.5
    return [t.to(device) for t in (q, k, v, g, beta, state)]


def _check_delta_rule(lengths, fresh, heads_k, heads_v, dk, dv, dtype, device):
    q, k, v, g, beta, state = _delta_inputs(lengths, heads_k, heads_v, dk, dv, dtype, device)
    cu, slots, has = _step(lengths, fresh, device, seed=1)
    meta = dict(cu_seqlens=cu, state_slots=slots, has_state=has)
    want_state = state.double().cpu()
    want = gated_delta_rule_ref(
        *(t.double().cpu() for t in (q, k, v, g, beta)),
        want_state,
        **{n: t.cpu() for n, t in meta.items()},
    )
    got_state = state.clone()
    got = gated_delta_rule(q, k, v, g, beta, got_state, max_seqlen_q=max(lengths), **meta)
    assert got.dtype == dtype and got.shape == v.shape
    atol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.double().cpu(), want, atol=atol, rtol=atol)
    torch.testing.assert_close(got_state.double().cpu(), want_state, atol=2e-5, rtol=2e-5)
    untouched = sorted(set(range(NUM_SLOTS)) - set(slots.tolist()))
    assert torch.equal(got_state[untouched], state[untouched])


DELTA_CASES = [
    # id, lengths, fresh sequences, Hk, Hv, Dk, Dv, dtype
    ("decode-recurrent", DECODE, {1}, 2, 4, 16, 24, torch.float32),
    ("decode-groups-of-1", DECODE, set(), 3, 3, 32, 16, torch.float32),
    ("prefill-1-to-3-chunks", PREFILL, {0, 3}, 2, 4, 16, 24, torch.float32),
    ("prefill-groups-of-4", PREFILL, {2}, 1, 4, 24, 40, torch.float32),
    ("mixed", MIXED, {1, 3}, 2, 4, 16, 24, torch.float32),
    ("mixed-bf16", MIXED, {0}, 2, 2, 32, 32, torch.bfloat16),
]


@pytest.mark.parametrize(
    "lengths,fresh,hk,hv,dk,dv,dtype", [c[1:] for c in DELTA_CASES], ids=[c[0] for c in DELTA_CASES]
)
def test_gated_delta_rule_matches_the_reference(lengths, fresh, hk, hv, dk, dv, dtype, device):
    _check_delta_rule(lengths, fresh, hk, hv, dk, dv, dtype, device)


def test_gated_delta_rule_in_both_reduction_orders(device, interpreter_order):
    _check_delta_rule(MIXED, {1}, 2, 4, 16, 24, torch.float32, device)
    _check_delta_rule(DECODE, {0}, 2, 4, 16, 24, torch.float32, device)


def test_chunked_kernel_takes_decode_rows_too(device):
    """A decode row inside a prefill step runs the chunked kernel: same as the recurrent one."""
    q, k, v, g, beta, state = _delta_inputs(DECODE, 2, 4, 16, 24, torch.float32, device)
    cu, slots, has = _step(DECODE, {2}, device, seed=1)
    meta = dict(cu_seqlens=cu, state_slots=slots, has_state=has)
    recurrent, chunked = state.clone(), state.clone()
    a = gated_delta_rule(q, k, v, g, beta, recurrent, max_seqlen_q=1, **meta)
    b = gated_delta_rule(q, k, v, g, beta, chunked, max_seqlen_q=2, **meta)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(recurrent, chunked, atol=1e-6, rtol=1e-6)


def _check_conv(lengths, fresh, channels, width, bias, dtype, device):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(sum(lengths), channels, generator=gen).to(dtype).to(device)
    weight = torch.randn(channels, width, generator=gen).to(dtype).to(device)
    b = torch.randn(channels, generator=gen).to(dtype).to(device) if bias else None
    window = torch.randn(NUM_SLOTS, width - 1, channels, generator=gen).to(dtype).to(device)
    cu, slots, has = _step(lengths, fresh, device, seed=3)
    meta = dict(cu_seqlens=cu, state_slots=slots, has_state=has)
    want_window = window.double().cpu()
    want = causal_conv1d_ref(
        x.double().cpu(),
        weight.double().cpu(),
        None if b is None else b.double().cpu(),
        want_window,
        **{n: t.cpu() for n, t in meta.items()},
    )
    got_window = window.clone()
    got = causal_conv1d(x, weight, b, got_window, **meta)
    atol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.double().cpu(), want, atol=atol, rtol=atol)
    # The window is data movement: exact in the input dtype.
    assert torch.equal(got_window.cpu(), want_window.to(dtype))


CONV_CASES = [
    # id, lengths, fresh, C, K, bias, dtype
    ("decode-k4", DECODE, {0}, 40, 4, False, torch.float32),
    ("prefill-k4-bias", PREFILL, {1}, 200, 4, True, torch.float32),
    ("shorter-than-window", [1, 2, 3, 1], {3}, 40, 4, False, torch.float32),
    ("mixed-k2", MIXED, {2}, 40, 2, True, torch.float32),
    ("mixed-k3-bf16", MIXED, {0}, 130, 3, False, torch.bfloat16),
]


@pytest.mark.parametrize(
    "lengths,fresh,channels,width,bias,dtype",
    [c[1:] for c in CONV_CASES],
    ids=[c[0] for c in CONV_CASES],
)
def test_causal_conv_matches_the_reference(lengths, fresh, channels, width, bias, dtype, device):
    _check_conv(lengths, fresh, channels, width, bias, dtype, device)


def test_causal_conv_in_both_reduction_orders(device, interpreter_order):
    _check_conv(MIXED, {1}, 40, 4, True, torch.float32, device)


def test_the_kernels_refuse_what_they_cannot_run(device):
    q, k, v, g, beta, state = _delta_inputs([3], 2, 4, 16, 24, torch.float32, device)
    cu, slots, has = _step([3], set(), device, seed=1)
    meta = dict(cu_seqlens=cu, state_slots=slots, has_state=has, max_seqlen_q=3)
    with pytest.raises(ValueError, match="state must be fp32"):
        gated_delta_rule(q, k, v, g, beta, state.half(), **meta)
    with pytest.raises(ValueError, match="does not fit"):
        gated_delta_rule(q, k, v[:, :3], g, beta, state, **meta)
    with pytest.raises(ValueError, match="one layout"):
        gated_delta_rule(q, k, v, g, beta.t().contiguous().t(), state, **meta)
    x = torch.randn(3, 40, device=device)
    window = torch.zeros(NUM_SLOTS, 3, 40, device=device)
    with pytest.raises(ValueError, match="do not match"):
        causal_conv1d(
            x,
            torch.randn(40, 3, device=device),
            None,
            window,
            **{n: meta[n] for n in ("cu_seqlens", "state_slots", "has_state")},
        )
