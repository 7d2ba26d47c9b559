"""Split-KV partials merged inside the attention kernels (``fuse_merge``) vs the reduce kernel.

In a decode step, the last split program of each (sequence, head block) to count itself on its
ticket merges
every split's partial in index order, the reduce kernel's order, so the fused result must equal
the two-launch result bit for bit, match the reference, and leave every ticket at zero (CUDA
graphs replay the same counters). Under the interpreter the programs run one after another;
``ci/gpu-check.sh`` runs the same cases on a GPU (its kernel steps), where they race.
"""

from __future__ import annotations

import pytest
import torch

from paged_serve.kernels.reference import mla_attention_ref, paged_attention_ref
from paged_serve.kernels.triton.attention_checks import AttentionShapes
from paged_serve.kernels.triton.mla_attention import MlaShapes, mla_attention, mla_launch
from paged_serve.kernels.triton.paged_attention import attention_launch, paged_attention
from paged_serve.kernels.triton.runtime import zeroed_tickets

DECODE_5 = [(1, 1), (1, 40), (1, 97), (1, 16), (1, 130)]

CASES = [
    # id, seqs, (Hq, Hkv), head_dim, dtype, splits, window, softcap, sinks
    ("decode-fp32-split3", DECODE_5, (8, 2), 64, torch.float32, 3, None, None, False),
    ("decode-fp16-split5-sinks", DECODE_5, (9, 3), 80, torch.float16, 5, None, None, True),
    ("decode-fp32-split2-window-softcap", DECODE_5, (4, 4), 64, torch.float32, 2, 33, 3.0, False),
    ("decode-bf16-split4", DECODE_5[:2], (16, 2), 128, torch.bfloat16, 4, None, None, False),
    ("decode-fp32-split3-sinks-window", DECODE_5, (8, 2), 64, torch.float32, 3, 50, None, True),
    ("decode-fp32-split9", DECODE_5, (8, 2), 64, torch.float32, 9, None, None, False),
]


def _attend(batch, fuse_merge, *, splits, window, softcap, sinks, **extra):
    kwargs = dict(
        batch.kwargs(),
        scale=batch.q.shape[-1] ** -0.5 * 2,
        sliding_window=window,
        softcap=softcap,
        sinks=sinks,
    )
    out = paged_attention(
        batch.q, batch.k_cache, batch.v_cache, num_kv_splits=splits, fuse_merge=fuse_merge,
        **kwargs, **extra,
    )  # fmt: skip
    return out, kwargs


@pytest.mark.parametrize(
    "seqs,heads,head_dim,dtype,splits,window,softcap,with_sinks",
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_fused_merge_equals_the_reduce_kernel_bit_for_bit(
    paged_batch, device, seqs, heads, head_dim, dtype, splits, window, softcap, with_sinks
):
    batch = paged_batch(
        seqs,
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
        device=device,
    )
    sinks = torch.linspace(-1.0, 2.0, heads[0], device=device) if with_sinks else None
    options = dict(splits=splits, window=window, softcap=softcap, sinks=sinks)
    fused, kwargs = _attend(batch, True, **options)
    reduced, _ = _attend(batch, False, **options)
    assert torch.equal(fused, reduced)
    ref = paged_attention_ref(batch.q.float(), batch.k_cache, batch.v_cache, **kwargs)
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(fused.float(), ref, atol=tol, rtol=tol)
    assert not zeroed_tickets(device, 4096).any()  # every ticket back at zero


def test_caller_tickets_are_used_and_left_zero(paged_batch, device):
    batch = paged_batch(
        DECODE_5, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32, device=device,
    )  # fmt: skip
    options = dict(splits=3, window=None, softcap=None, sinks=None)
    tickets = torch.zeros(5 * 2 + 3, dtype=torch.int32, device=device)
    out, _ = _attend(batch, True, tickets=tickets, **options)
    expected, _ = _attend(batch, False, **options)
    assert torch.equal(out, expected)
    assert not tickets.any()
    # A ticket left at the last split's count makes that program's first split merge before
    # the others wrote (here NaN partials): the kernel counts on the caller's counters.
    tickets[0] = 2
    workspace = torch.full((5 * 8 * 3 * 65,), float("nan"), device=device)
    stale, _ = _attend(batch, True, tickets=tickets, workspace=workspace, **options)
    assert stale[0, :4].isnan().all()  # sequence 0's first KV head: its 4 query heads
    assert torch.equal(stale[0, 4:], expected[0, 4:]) and torch.equal(stale[1:], expected[1:])


@pytest.mark.parametrize(
    "tickets,message",
    [
        (lambda d: torch.zeros(9, dtype=torch.int32, device=d), ">= 10 elements"),
        (lambda d: torch.zeros(10, dtype=torch.int64, device=d), "int32"),
        (lambda d: torch.zeros(20, dtype=torch.int32, device=d)[::2], "contiguous"),
    ],
    ids=["too-few", "int64", "strided"],
)
def test_bad_tickets_are_refused(paged_batch, device, tickets, message):
    batch = paged_batch(
        DECODE_5, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32, device=device,
    )  # fmt: skip
    with pytest.raises(ValueError, match=message):
        _attend(
            batch, True, splits=3, window=None, softcap=None, sinks=None, tickets=tickets(device)
        )


def test_the_launch_merges_in_kernel_only_when_split():
    shapes = AttentionShapes(
        num_tokens=5, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, num_seqs=5
    )
    common = dict(dtype=torch.float16, max_seqlen_q=1, max_seqlen_k=9000, sliding_window=None)
    split = attention_launch(shapes, num_kv_splits=None, **common)
    assert split.split and split.merge_in_kernel and split.constexprs()["MERGE"]
    assert split.num_tickets == 5 * 2  # one per (sequence, KV head) of a decode step
    two_launches = attention_launch(shapes, num_kv_splits=None, fuse_merge=False, **common)
    assert two_launches.split and not two_launches.merge_in_kernel
    assert not attention_launch(shapes, num_kv_splits=1, **common).constexprs()["MERGE"]
    # steps with prefill chunks keep the reduce kernel (the fold spilled their D=256 builds)
    prefill = attention_launch(shapes, num_kv_splits=3, **{**common, "max_seqlen_q": 4})
    assert prefill.split and not prefill.merge_in_kernel
    mla = mla_launch(
        MlaShapes(3, 20, 32, 16, 16, 3), dtype=torch.float32, max_seqlen_q=1, max_seqlen_k=4000,
        num_kv_splits=4, num_sms=132,
    )  # fmt: skip
    assert mla.merge_in_kernel and mla.num_tickets == 3 * 2  # 20 heads: two blocks of 16


@pytest.mark.parametrize("heads", [4, 20])
def test_mla_fused_merge_equals_the_reduce_kernel_bit_for_bit(paged_batch, device, heads):
    batch = paged_batch(
        DECODE_5, num_q_heads=heads, num_kv_heads=1, head_dim=48 + 8, block_size=16,
        dtype=torch.float32, device=device,
    )  # fmt: skip
    cache = batch.k_cache[:, :, 0]
    kwargs = dict(batch.kwargs(), scale=0.15, kv_lora_rank=48)
    fused = mla_attention(batch.q, cache, num_kv_splits=3, **kwargs)
    reduced = mla_attention(batch.q, cache, num_kv_splits=3, fuse_merge=False, **kwargs)
    assert torch.equal(fused, reduced)
    ref = mla_attention_ref(batch.q, cache, **kwargs)
    torch.testing.assert_close(fused, ref, atol=1e-5, rtol=1e-5)
    assert not zeroed_tickets(device, 4096).any()


def test_the_ticket_pool_grows_and_starts_zero(device):
    small = zeroed_tickets(device, 10)
    assert small.dtype == torch.int32 and small.numel() == 10 and not small.any()
    large = zeroed_tickets(device, 5000)
    assert large.numel() == 5000 and not large.any()
    assert zeroed_tickets(device, 10).data_ptr() == large.data_ptr()  # one pool, its start
