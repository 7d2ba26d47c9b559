"""KV-cache write kernel vs ``reference.write_kv_ref``: bit-exact, slot -1 skipped."""

from __future__ import annotations

import pytest
import torch

from paged_serve.kernels.reference import write_kv_ref
from paged_serve.kernels.triton import block_copy, kv_write, paged_attention, sampling
from paged_serve.kernels.triton.kv_write import write_kv


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is used only without CUDA")
def test_kernels_are_interpreted_without_cuda():
    """conftest sets TRITON_INTERPRET=1 early enough: every kernel was decorated as interpreted."""
    kernels = [
        kv_write._write_kv_kernel,
        block_copy._copy_blocks_kernel,
        paged_attention._paged_attention_kernel,
        paged_attention._paged_attention_reduce_kernel,
        sampling._sample_kernel,
        sampling._uniforms_kernel,
    ]
    assert {type(k).__name__ for k in kernels} == {"InterpretedFunction"}


def _caches(num_blocks, block_size, num_kv_heads, head_dim, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
    v_cache = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
    return k_cache, v_cache


@pytest.mark.parametrize(
    "num_tokens,num_kv_heads,head_dim,block_size,dtype",
    [
        (1, 1, 64, 16, torch.float32),
        (13, 3, 80, 16, torch.float16),
        (40, 2, 128, 32, torch.bfloat16),
        (7, 8, 256, 16, torch.float32),
        (5, 5, 96, 32, torch.float16),
    ],
)
def test_matches_reference_exactly(device, num_tokens, num_kv_heads, head_dim, block_size, dtype):
    num_blocks = 6
    k_cache, v_cache = _caches(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    gen = torch.Generator().manual_seed(1)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    # Distinct slots in random order, every third token skipped.
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::3] = -1
    slot_mapping = slots.to(device)

    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_ref(key, value, k_ref, v_ref, slot_mapping=slot_mapping)
    write_kv(key, value, k_cache, v_cache, slot_mapping=slot_mapping)
    assert torch.equal(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)


def test_skipped_slots_leave_cache_untouched(device):
    k_cache, v_cache = _caches(4, 16, 2, 64, torch.float32, device)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    key = torch.full((5, 2, 64), float("nan"), device=device)
    write_kv(
        key,
        key.clone(),
        k_cache,
        v_cache,
        slot_mapping=torch.full((5,), -1, dtype=torch.int64, device=device),
    )
    assert torch.equal(k_cache, before_k) and torch.equal(v_cache, before_v)


def test_strided_key_value(device):
    """key/value may be views of a fused QKV projection (row stride != Hkv * D)."""
    k_cache, v_cache = _caches(3, 16, 2, 64, torch.float16, device)
    fused = torch.randn(9, 3, 2, 64, device=device).half()
    key, value = fused[:, 1], fused[:, 2]
    assert not key.is_contiguous()
    slot_mapping = torch.tensor([47, 0, -1, 16, 5, 33, -1, 2, 31], device=device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_ref(key, value, k_ref, v_ref, slot_mapping=slot_mapping)
    write_kv(key, value, k_cache, v_cache, slot_mapping=slot_mapping)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_empty_step_is_a_no_op(device):
    k_cache, v_cache = _caches(2, 16, 2, 64, torch.float32, device)
    before = k_cache.clone()
    empty = torch.empty(0, 2, 64, device=device)
    write_kv(
        empty,
        empty,
        k_cache,
        v_cache,
        slot_mapping=torch.empty(0, dtype=torch.int64, device=device),
    )
    assert torch.equal(k_cache, before)


BAD_INPUTS = {
    "key-2d": dict(key=lambda k: k[:, 0]),
    "value-shape": dict(value=lambda v: v[:2]),
    "cache-heads": dict(k_cache=lambda c: c[:, :, :1], v_cache=lambda c: c[:, :, :1]),
    "dtype-mismatch": dict(key=lambda k: k.half()),
    "slot-int32": dict(slot_mapping=lambda s: s.int()),
    "slot-length": dict(slot_mapping=lambda s: s[:2]),
    "cache-not-contiguous": dict(k_cache=lambda c: c.transpose(0, 1)),
    "key-last-dim-strided": dict(key=lambda k: k.transpose(1, 2).contiguous().transpose(1, 2)),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_validation_raises_value_error(device, case):
    k_cache, v_cache = _caches(2, 16, 2, 64, torch.float32, device)
    args = dict(
        key=torch.randn(3, 2, 64, device=device),
        value=torch.randn(3, 2, 64, device=device),
        k_cache=k_cache,
        v_cache=v_cache,
        slot_mapping=torch.tensor([0, 1, 2], device=device),
    )
    for name, change in BAD_INPUTS[case].items():
        args[name] = change(args[name])
    with pytest.raises(ValueError):
        write_kv(
            args.pop("key"), args.pop("value"), args.pop("k_cache"), args.pop("v_cache"), **args
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_validation_device_mismatch():
    k_cache, v_cache = _caches(2, 16, 2, 64, torch.float32, torch.device("cuda"))
    key = torch.randn(3, 2, 64, device="cuda")
    with pytest.raises(ValueError, match="cpu"):
        write_kv(key, key, k_cache, v_cache, slot_mapping=torch.tensor([0, 1, 2]))
