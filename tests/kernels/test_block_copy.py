"""Block-copy kernel vs ``reference.copy_blocks_ref``: bit-exact, all layers in one launch."""

from __future__ import annotations

import pytest
import torch

from paged_serve.kernels.reference import copy_blocks_ref
from paged_serve.kernels.triton.block_copy import copy_blocks


@pytest.mark.parametrize(
    "num_layers,sides,block_size,num_kv_heads,head_dim,dtype,mapping",
    [
        (1, 2, 16, 1, 64, torch.float32, [(0, 1)]),
        (3, 2, 16, 3, 80, torch.float16, [(2, 5), (0, 7), (6, 1)]),
        (2, 2, 32, 2, 128, torch.bfloat16, [(7, 0), (3, 4)]),
        # block_numel = 32 * 8 * 128 = 32768 > 4096: several chunks per block.
        (2, 2, 32, 8, 128, torch.float32, [(1, 6), (5, 2), (0, 3)]),
        # a latent cache: one side, one "head" of 512 + 64 lanes
        (3, 1, 16, 1, 576, torch.bfloat16, [(4, 2), (0, 6)]),
    ],
)
def test_matches_reference_exactly(
    device, num_layers, sides, block_size, num_kv_heads, head_dim, dtype, mapping
):
    gen = torch.Generator().manual_seed(0)
    shape = (num_layers, sides, 8, block_size, num_kv_heads, head_dim)
    kv_caches = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
    block_mapping = torch.tensor(mapping, dtype=torch.int64, device=device)
    original = kv_caches.clone()
    expected = kv_caches.clone()
    copy_blocks_ref(expected, block_mapping=block_mapping)
    copy_blocks(kv_caches, block_mapping=block_mapping)
    assert torch.equal(kv_caches, expected)
    # The copy really happened (the reference is not a no-op on this data) ...
    src, dst = mapping[0]
    assert torch.equal(kv_caches[:, :, dst], kv_caches[:, :, src])
    # ... and blocks that are not destinations are untouched.
    untouched = sorted(set(range(8)) - {d for _, d in mapping})
    assert torch.equal(kv_caches[:, :, untouched], original[:, :, untouched])


def test_empty_mapping_is_a_no_op(device):
    kv_caches = torch.randn(2, 2, 4, 16, 2, 64, device=device)
    before = kv_caches.clone()
    copy_blocks(kv_caches, block_mapping=torch.empty(0, 2, dtype=torch.int64, device=device))
    assert torch.equal(kv_caches, before)


BAD_INPUTS = {
    "caches-5d": (lambda c: c[0], lambda m: m),
    "caches-side-3": (lambda c: torch.cat([c, c[:, :1]], dim=1), lambda m: m),
    "caches-not-contiguous": (lambda c: c.transpose(3, 4), lambda m: m),
    "mapping-int32": (lambda c: c, lambda m: m.int()),
    "mapping-1d": (lambda c: c, lambda m: m.flatten()),
    "mapping-3-cols": (lambda c: c, lambda m: torch.cat([m, m[:, :1]], dim=1)),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_validation_raises_value_error(device, case):
    change_caches, change_mapping = BAD_INPUTS[case]
    kv_caches = torch.randn(2, 2, 4, 16, 2, 64, device=device)
    mapping = torch.tensor([[0, 1]], dtype=torch.int64, device=device)
    with pytest.raises(ValueError):
        copy_blocks(change_caches(kv_caches), block_mapping=change_mapping(mapping))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_validation_device_mismatch():
    kv_caches = torch.randn(2, 2, 4, 16, 2, 64, device="cuda")
    with pytest.raises(ValueError, match="cpu"):
        copy_blocks(kv_caches, block_mapping=torch.tensor([[0, 1]]))
