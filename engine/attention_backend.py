"""Attention backends: who runs the KV write, block copy, attention and sampling.

``torch`` runs the eager references of ``kernels/reference.py`` (the CPU default: Triton's
interpreter is far too slow to serve); ``triton`` runs our kernels (the CUDA default).
"""

from __future__ import annotations

import os
from typing import Protocol

import torch

from kernels import reference


class AttentionBackend(Protocol):
    name: str

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        *,
        slot_mapping: torch.Tensor,
    ) -> None: ...

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        *,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        scale: float,
        max_seqlen_q: int,
        max_seqlen_k: int,
        sliding_window: int | None,
    ) -> torch.Tensor: ...

    def copy_blocks(self, kv_caches: torch.Tensor, *, block_mapping: torch.Tensor) -> None: ...


class TorchBackend:
    """The eager PyTorch path (fp32 math)."""

    name = "torch"

    def write_kv(self, key, value, k_cache, v_cache, *, slot_mapping):
        reference.write_kv_ref(key, value, k_cache, v_cache, slot_mapping=slot_mapping)

    def attention(
        self,
        q,
        k_cache,
        v_cache,
        *,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        scale,
        max_seqlen_q,
        max_seqlen_k,
        sliding_window,
    ):
        return reference.paged_attention_ref(
            q,
            k_cache,
            v_cache,
            block_tables=block_tables,
            seq_lens=seq_lens,
            cu_seqlens_q=cu_seqlens_q,
            scale=scale,
            sliding_window=sliding_window,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
        )

    def copy_blocks(self, kv_caches, *, block_mapping):
        reference.copy_blocks_ref(kv_caches, block_mapping=block_mapping)


class TritonBackend:
    """Our Triton kernels (on CPU only under ``TRITON_INTERPRET=1``)."""

    name = "triton"

    def __init__(self) -> None:
        from kernels.block_copy import copy_blocks
        from kernels.kv_write import write_kv
        from kernels.paged_attention import paged_attention

        self._write_kv = write_kv
        self._copy_blocks = copy_blocks
        self._paged_attention = paged_attention

    def write_kv(self, key, value, k_cache, v_cache, *, slot_mapping):
        self._write_kv(
            key.contiguous(), value.contiguous(), k_cache, v_cache, slot_mapping=slot_mapping
        )

    def attention(
        self,
        q,
        k_cache,
        v_cache,
        *,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        scale,
        max_seqlen_q,
        max_seqlen_k,
        sliding_window,
    ):
        return self._paged_attention(
            q.contiguous(),
            k_cache,
            v_cache,
            block_tables=block_tables,
            seq_lens=seq_lens,
            cu_seqlens_q=cu_seqlens_q,
            scale=scale,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            sliding_window=sliding_window,
        )

    def copy_blocks(self, kv_caches, *, block_mapping):
        self._copy_blocks(kv_caches, block_mapping=block_mapping)


def resolve_backend_name(requested: str, device: torch.device) -> str:
    """``auto`` is triton on CUDA and torch elsewhere; triton on CPU needs the interpreter."""
    if requested == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if (
        requested == "triton"
        and device.type != "cuda"
        and os.environ.get("TRITON_INTERPRET") != "1"
    ):
        raise ValueError(
            "the triton backend on a CPU needs TRITON_INTERPRET=1 (and is slow): "
            "use --attention-backend torch"
        )
    return requested


def make_backend(name: str) -> AttentionBackend:
    if name == "torch":
        return TorchBackend()
    if name == "triton":
        return TritonBackend()
    raise ValueError(f"unknown attention backend {name!r}")
