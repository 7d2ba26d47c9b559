"""The CPU's Mamba-2 scan (``engine/platform/cpu/ssm.py``: decode rows batched, prefill in
64-token blocks of the chunked dual form) against ``ssd_scan_ref`` in float64, on steps of
decode rows, prefills of one to three blocks, a 300-token prefill and mixed steps, with fresh
sequences (garbage in their slots) beside continuing ones, B and C shared by all heads or by
pairs, P and N not powers of two, with and without D, in float64, fp32 and with bf16 inputs."""

from __future__ import annotations

import pytest
import torch

from paged_serve.engine.platform.cpu import ssm
from paged_serve.engine.platform.cpu.ssm import ssd_scan_cpu
from paged_serve.kernels.reference import ssd_scan_ref

STEPS = {
    "decode": ([1, 1, 1, 1, 1], {1}),
    "prefill": ([63, 64, 65, 150], {0, 2}),
    "long-prefill": ([300], {0}),
    "mixed": ([1, 40, 1, 3, 0, 1], {1, 4}),
}
SHAPES = {  # H, G, P, N
    "pairs": (4, 2, 24, 20),
    "one-group": (3, 1, 40, 12),
}
SLOTS = 9


def _meta(lengths: list[int], fresh: set[int]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(len(lengths))
    return dict(
        cu_seqlens=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32),
        state_slots=torch.randperm(SLOTS, generator=gen)[: len(lengths)].to(torch.int32),
        has_state=torch.tensor(
            [int(i not in fresh) for i in range(len(lengths))], dtype=torch.int32
        ),
    )


def _inputs(tokens: int, shape: tuple[int, int, int, int], skip: bool, seed: int = 0):
    heads, groups, p, n = shape
    gen = torch.Generator().manual_seed(seed)
    xbc = torch.randn(tokens, heads * p + 2 * groups * n, generator=gen)  # one projection's views
    x = xbc[:, : heads * p].unflatten(-1, (heads, p))
    B = xbc[:, heads * p : heads * p + groups * n].unflatten(-1, (groups, n))
    C = xbc[:, heads * p + groups * n :].unflatten(-1, (groups, n))
    dt = torch.rand(tokens, heads, generator=gen) * 0.5 + 0.01
    A = -(1 + torch.rand(heads, generator=gen) * 7)  # dt * A down to -4 a token
    D = torch.randn(heads, generator=gen) if skip else None
    state = torch.randn(SLOTS, heads, p, n, generator=gen)
    return x, dt, A, B, C, D, state


def _double(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.double()


@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_ssd_scan(step: str, shape: str, dtype: torch.dtype) -> None:
    _check(step, shape, dtype)


def test_long_prefills_go_in_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    """300 tokens in 128-token segments (the state carried between them) still match."""
    monkeypatch.setattr(ssm, "SEGMENT", 2 * ssm.CHUNK)
    _check("long-prefill", "pairs", torch.float64)
    _check("prefill", "one-group", torch.float32)


def _check(step: str, shape: str, dtype: torch.dtype) -> None:
    lengths, fresh = STEPS[step]
    meta = _meta(lengths, fresh)
    x, dt, A, B, C, D, state = _inputs(sum(lengths), SHAPES[shape], skip=shape == "pairs")
    want_state = state.double()
    want = ssd_scan_ref(*(_double(t) for t in (x, dt, A, B, C, D)), want_state, **meta)
    got_state = state.to(dtype)
    cast = (None if t is None else t.to(dtype) for t in (x, dt, A, B, C, D))
    got = ssd_scan_cpu(*cast, got_state, max_seqlen_q=max(lengths), **meta)
    assert got.dtype == dtype and got.shape == x.shape
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(got_state.double(), want_state, atol=tol, rtol=tol)
    untouched = sorted(set(range(SLOTS)) - set(meta["state_slots"].tolist()))
    assert torch.equal(got_state[untouched], state[untouched].to(dtype))


@pytest.mark.parametrize("step", ["mixed", "prefill"])
def test_bf16_inputs(step: str) -> None:
    """bf16 x, B and C with fp32 states: y in bf16, the math in fp32."""
    lengths, fresh = STEPS[step]
    meta = _meta(lengths, fresh)
    x, dt, A, B, C, D, state = _inputs(sum(lengths), SHAPES["pairs"], skip=True, seed=3)
    x, B, C = (t.bfloat16() for t in (x, B, C))
    want_state = state.double()
    want = ssd_scan_ref(*(_double(t) for t in (x, dt, A, B, C, D)), want_state, **meta)
    got_state = state.clone()
    got = ssd_scan_cpu(x, dt, A, B, C, D, got_state, max_seqlen_q=max(lengths), **meta)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got_state.double(), want_state, atol=2e-5, rtol=2e-5)


def test_the_state_carries_across_steps() -> None:
    """Prefills of 100 and 5 tokens, then two decode steps, each through the slot, equal the
    reference over all 107 tokens in one step."""
    lengths = [100, 5, 1, 1]
    x, dt, A, B, C, D, state = (
        None if t is None else t.double() for t in _inputs(sum(lengths), SHAPES["pairs"], skip=True)
    )
    slot = torch.tensor([4], dtype=torch.int32)
    want_state = state.clone()
    want = ssd_scan_ref(
        x, dt, A, B, C, D, want_state,
        cu_seqlens=torch.tensor([0, sum(lengths)], dtype=torch.int32), state_slots=slot,
        has_state=torch.zeros(1, dtype=torch.int32),
    )  # fmt: skip
    outs, a = [], 0
    for i, length in enumerate(lengths):
        rows = slice(a, a + length)
        outs.append(
            ssd_scan_cpu(
                x[rows],
                dt[rows],
                A,
                B[rows],
                C[rows],
                D,
                state,
                cu_seqlens=torch.tensor([0, length], dtype=torch.int32),
                state_slots=slot,
                has_state=torch.full((1,), int(i > 0), dtype=torch.int32),
                max_seqlen_q=length,
            )  # fmt: skip
        )
        a += length
    torch.testing.assert_close(torch.cat(outs), want, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(state, want_state, atol=1e-12, rtol=1e-12)
