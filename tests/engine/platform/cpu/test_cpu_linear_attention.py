"""The CPU's gated DeltaNet kernels (``engine/platform/cpu/linear_attention.py``: decode rows
batched, prefill in 64-token WY blocks) against the references in float64, on steps of decode
rows, prefills of one to three blocks and mixed steps, with fresh and continuing sequences."""

from __future__ import annotations

import pytest
import torch

from paged_serve.engine.platform.cpu.linear_attention import causal_conv1d_cpu, gated_delta_rule_cpu
from paged_serve.kernels.reference import causal_conv1d_ref, gated_delta_rule_ref

STEPS = {
    "decode": ([1, 1, 1, 1, 1], {1}),
    "prefill": ([63, 64, 65, 150], {0, 2}),
    "mixed": ([1, 40, 1, 3, 1], {1, 4}),
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


@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gated_delta_rule(step: str, dtype: torch.dtype) -> None:
    lengths, fresh = STEPS[step]
    meta = _meta(lengths, fresh)
    gen = torch.Generator().manual_seed(0)
    tokens, hk, hv, dk, dv = sum(lengths), 2, 4, 16, 24
    q, k = (torch.randn(tokens, hk, dk, generator=gen) for _ in range(2))
    v = torch.randn(tokens, hv, dv, generator=gen)
    g = -torch.rand(tokens, hv, generator=gen) * 3
    beta = torch.rand(tokens, hv, generator=gen)
    state = torch.randn(SLOTS, hv, dk, dv, generator=gen)
    want_state = state.double()
    want = gated_delta_rule_ref(*(t.double() for t in (q, k, v, g, beta)), want_state, **meta)
    got_state = state.to(dtype)
    got = gated_delta_rule_cpu(
        *(t.to(dtype) for t in (q, k, v, g, beta)), got_state, max_seqlen_q=max(lengths), **meta
    )
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(got_state.double(), want_state, atol=tol, rtol=tol)


@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("bias", [False, True])
def test_causal_conv(step: str, bias: bool) -> None:
    lengths, fresh = STEPS[step]
    meta = _meta(lengths, fresh)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(sum(lengths), 48, generator=gen)
    weight = torch.randn(48, 4, generator=gen)
    b = torch.randn(48, generator=gen) if bias else None
    window = torch.randn(SLOTS, 3, 48, generator=gen)
    want_window = window.double()
    want = causal_conv1d_ref(
        x.double(), weight.double(), None if b is None else b.double(), want_window, **meta
    )
    got_window = window.clone()
    got = causal_conv1d_cpu(x, weight, b, got_window, **meta)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_window, want_window.float())
