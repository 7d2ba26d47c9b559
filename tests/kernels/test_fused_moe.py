"""The fused mixture-of-experts kernel against ``reference.fused_moe_ref`` (fp32, pair by pair).

Cases: experts that receive no token, top-k 1 to 8, hidden and intermediate sizes that are not
powers of two, one token and many, fp32 and bf16, biases and gpt-oss's clamped SwiGLU on
interleaved gate/up columns, weights stored ``[E, in, out]`` (passed transposed). The pair
alignment is checked on its own: every pair once, blocks of one expert, no block for an expert
nobody chose.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paged_serve.kernels.reference import fused_moe_ref
from paged_serve.kernels.triton.fused_moe import BLOCK_M, align_pairs, fused_moe

TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (3e-2, 3e-2)}


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def clamped_swiglu(gate_up: torch.Tensor, limit: float = 7.0, alpha: float = 1.702) -> torch.Tensor:
    """gpt-oss's gate: interleaved gate/up columns, clamped."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


def _routing(num_tokens: int, num_experts: int, top_k: int, gen: torch.Generator, skip: int = 0):
    """Top-k of random router logits over all but the last ``skip`` experts (which get none)."""
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    if skip:
        logits[:, -skip:] = float("-inf")
    weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    return ids, weights / weights.sum(-1, keepdim=True)


CASES = [
    # id, tokens, experts, top_k, hidden, intermediate, dtype, skip, biased, transposed
    ("decode-1-top2", 1, 8, 2, 64, 32, torch.float32, 0, False, False),
    ("8-tokens-top1", 8, 4, 1, 96, 48, torch.float32, 0, False, False),
    ("33-tokens-top8-idle-experts", 33, 16, 8, 80, 24, torch.float32, 4, False, False),
    ("odd-sizes-top4", 19, 6, 4, 100, 70, torch.float32, 2, False, False),
    ("bf16-top2", 12, 8, 2, 128, 64, torch.bfloat16, 3, False, False),
    ("gpt-oss-biased-transposed", 10, 4, 2, 64, 40, torch.float32, 0, True, True),
]


@pytest.mark.parametrize(
    "tokens,experts,top_k,hidden,inter,dtype,skip,biased,transposed",
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_matches_reference(
    device, tokens, experts, top_k, hidden, inter, dtype, skip, biased, transposed
):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w1 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    b1 = torch.randn(experts, 2 * inter, generator=gen).to(dtype) if biased else None
    b2 = torch.randn(experts, hidden, generator=gen).to(dtype) if biased else None
    ids, weights = _routing(tokens, experts, top_k, gen, skip)
    gate = clamped_swiglu if biased else swiglu
    want = fused_moe_ref(x, w1, w2, ids, weights, apply_gate=gate, gate_up_bias=b1, down_bias=b2)
    on = {"device": device}
    w1_dev, w2_dev = w1.to(**on), w2.to(**on)
    if transposed:  # stored [E, in, out], as gpt-oss keeps them: passed as transposed views
        w1_dev = w1_dev.transpose(1, 2).contiguous().transpose(1, 2)
        w2_dev = w2_dev.transpose(1, 2).contiguous().transpose(1, 2)
    got = fused_moe(
        x.to(**on),
        w1_dev,
        w2_dev,
        ids.to(**on),
        weights.to(**on),
        apply_gate=gate,
        gate_up_bias=None if b1 is None else b1.to(**on),
        down_bias=None if b2 is None else b2.to(**on),
    )
    assert got.dtype == dtype and got.shape == x.shape
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (37, 16, 8), (5, 64, 3)])
def test_pairs_align_into_blocks_of_one_expert(tokens: int, experts: int, top_k: int) -> None:
    gen = torch.Generator().manual_seed(1)
    ids, _ = _routing(tokens, experts, top_k, gen, skip=experts // 4)
    pairs = align_pairs(ids, experts)
    num_pairs = tokens * top_k
    slots = pairs.pair_ids.tolist()
    assert sorted(p for p in slots if p < num_pairs) == list(range(num_pairs))  # each pair once
    flat = ids.reshape(-1).tolist()
    used = set(flat)
    owners = pairs.block_experts.tolist()
    for b, owner in enumerate(owners):
        block = [p for p in slots[b * BLOCK_M : (b + 1) * BLOCK_M] if p < num_pairs]
        if owner < 0:
            assert not block  # a block past the last run holds only padding
        else:
            assert block and {flat[p] for p in block} == {owner}
    assert {o for o in owners if o >= 0} == used  # an expert nobody chose gets no block
    assert len(slots) <= num_pairs + experts * (BLOCK_M - 1) + BLOCK_M
