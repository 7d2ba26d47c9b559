"""The planned torch backend, which keeps one step's plan for all its layers, equals the
references derived afresh on every call, bit for bit: on every attention case the kernel tests
use, across "layers" that share one step's metadata, and from step to step."""

from __future__ import annotations

import pytest
import torch

from engine.cpu_attention import PlannedTorchAttention
from kernels.reference import paged_attention_ref, write_kv_ref
from tests.kernels.conftest import build_paged_batch
from tests.kernels.test_paged_attention import CASES, _seqs

CPU = torch.device("cpu")


def _batch(spec, heads, head_dim, block_size, dtype, seed=0):
    torch.manual_seed(seed)
    return build_paged_batch(
        _seqs(spec, block_size),
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=CPU,
    )


@pytest.mark.parametrize(
    "spec,heads,head_dim,block_size,dtype,window",
    [(c[1], c[2], c[3], c[4], c[5], c[7]) for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_equals_the_reference_bit_for_bit(spec, heads, head_dim, block_size, dtype, window):
    batch = _batch(spec, heads, head_dim, block_size, dtype)
    kwargs = dict(batch.kwargs(), scale=head_dim**-0.5, sliding_window=window)
    planned = PlannedTorchAttention()
    # Two layers of one step: the second reuses the plan built for the first, on other caches.
    other_k, other_v = batch.k_cache * -2, batch.v_cache * 3  # NaN stays where no token is
    for k_cache, v_cache in ((batch.k_cache, batch.v_cache), (other_k, other_v)):
        out = planned.paged_attention(batch.q, k_cache, v_cache, **kwargs)
        ref = paged_attention_ref(batch.q, k_cache, v_cache, **kwargs)
        assert out.dtype == ref.dtype
        assert torch.equal(out, ref)


def test_a_new_step_gets_a_new_plan():
    planned = PlannedTorchAttention()
    for seed, spec in enumerate(([(1, (2, 3)), (1, (0, 5))], [(4, (1, 2)), (1, (3, 0))])):
        batch = _batch(spec, (8, 2), 64, 16, torch.float32, seed=seed)
        kwargs = dict(batch.kwargs(), scale=0.125)
        out = planned.paged_attention(batch.q, batch.k_cache, batch.v_cache, **kwargs)
        assert torch.equal(
            out, paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, **kwargs)
        )


@pytest.mark.parametrize("skip", [False, True])
def test_write_kv_equals_the_reference(skip: bool):
    torch.manual_seed(0)
    key, value = torch.randn(6, 2, 32), torch.randn(6, 2, 32)
    slots = torch.tensor([3, 17, -1 if skip else 40, 8, 63, -1 if skip else 0])
    planned = PlannedTorchAttention()
    for layer in range(2):  # the second layer reuses the slots planned for the first
        caches = [torch.zeros(4, 16, 2, 32) for _ in range(4)]
        planned.write_kv(key + layer, value, caches[0], caches[1], slot_mapping=slots)
        write_kv_ref(key + layer, value, caches[2], caches[3], slot_mapping=slots)
        assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
