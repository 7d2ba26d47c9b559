"""The ``torch`` attention backend: the CPU platform's attention plan, derived once a step.

An ``AttentionPlan`` (engine/platform/cpu/attention_plan.py: host copies of the metadata, which
rows decode, gather blocks, tail positions, masks) depends on a step's metadata alone, and
``write_kv_ref`` needs the slots to write. A step calls both once per layer with the *same*
metadata tensors (one ``AttentionContext``), so this backend keeps the plan and the slots from
the first layer for the others::

    layer 0:  plan = AttentionPlan.build(cu_seqlens_q, seq_lens, block_tables, ...)  # host work
    layer i:  plan.run(q, k_cache, v_cache, scale)                                  # tensor work

They are keyed on the identity of those tensors (held, so an id is never reused while it is the
key). The plan computes in the model's own dtype, as Hugging Face's ``sdpa`` attention does, with
HF's layout: in fp32 it equals the fp32 reference ``paged_attention_ref`` up to rounding, and in
bf16 each sequence gets what HF computes for it alone, so a request alone decodes HF's own bf16
tokens (tests/engine/platform/cpu/test_cpu_attention.py, tests/engine/test_greedy_equality.py). With
``group_alone`` (the runner sets it for weight-only quantized bf16 models, whose tokens are not HF's
anyway) a decode row alone takes the grouped layout too, 3-4.5x faster in bf16.

A step whose every sequence brings one token (a decode-only step) skips the plan when the
runner hands in ``decode_kernel``: the C kernel of ``kernels/cpu/decode_attention.py`` reads the
cache blocks in place, with no gather, in fp32 (equal to the reference up to fp32 rounding,
so fp32 greedy tokens still equal HF's: tests/engine/test_greedy_equality.py). An unquantized bf16
row alone stays on the plan, so that it keeps HF's own bf16 tokens. Steps with a prefill chunk
run the plan for every row. Every step's K/V write goes through the kernel's ``write_kv`` (a
``memcpy`` a row, bit-exact) when the tensors suit it.

A non-causal step (``causal=False``, bidirectional encoders) is planned without the causal
mask, and the plan is keyed on ``causal`` too. When every sequence of such a step is one token
long, that token sits at its sequence's last position and sees the same keys causal or not, so
the C kernel, which attends a row over its whole context (the latest ``w`` with a window),
takes it alike.

A chunked local attention layer (``attention_chunk`` C, Llama 4) is planned with the chunk
bound in its masks (and keyed on C); in a decode-only step the C kernel starts each row at its
chunk's start, ``(seq_len - 1) // C * C`` (or the window's, whichever is later).
"""

from __future__ import annotations

import torch

from paged_serve.engine.platform.cpu.attention_plan import AttentionPlan
from paged_serve.kernels.cpu.decode_attention import CpuDecodeAttention
from paged_serve.kernels.reference import (
    check_attention_chunk,
    kept_slots,
    quantize_kv_ref,
    scatter_kv,
)


class PlannedTorchAttention:
    """``write_kv`` and ``paged_attention`` with the reference's signatures, planned per step."""

    def __init__(
        self, *, group_alone: bool = False, decode_kernel: CpuDecodeAttention | None = None
    ) -> None:
        self.group_alone = group_alone  # a decode row alone grouped too (UniformGroup)
        self.decode_kernel = decode_kernel  # decode-only steps read the cache in place
        self._plan_key: tuple[object, ...] = ()
        self._plan: AttentionPlan | None = None
        self._slots_key: torch.Tensor | None = None
        self._slots: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        *,
        slot_mapping: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        """As ``write_kv_ref``: scatter ``[T, Hkv, D]`` at ``slot_mapping [T]`` (-1: skip); with
        ``k_scale``/``v_scale`` the caches hold codes: each row quantized, codes and scales
        written (``quantize_kv_ref``)."""
        kernel = self.decode_kernel
        quantized = k_scale is not None and v_scale is not None
        fits = kernel is not None and kernel.supports_write(key, value, k_cache, v_cache)
        if fits and not quantized:
            kernel.write_kv(key, value, k_cache, v_cache, slot_mapping=slot_mapping)
            return
        if self._slots_key is not slot_mapping:
            self._slots_key, self._slots = slot_mapping, kept_slots(slot_mapping)
        if quantized:
            key, k_row_scale = quantize_kv_ref(key, dtype=k_cache.dtype)
            value, v_row_scale = quantize_kv_ref(value, dtype=v_cache.dtype)
            scatter_kv(
                k_row_scale[..., None],
                v_row_scale[..., None],
                k_scale[..., None],
                v_scale[..., None],
                *self._slots,
            )
        scatter_kv(key, value, k_cache, v_cache, *self._slots)

    def paged_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        *,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_k: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        causal: bool = True,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        attention_chunk: int | None = None,
    ) -> torch.Tensor:
        """As ``paged_attention_ref``: ``q [T, Hq, D]`` over the paged cache, the math in q's
        dtype (fp32 in the C kernel, which decode-only steps take: ``_decodes_in_place``).
        ``causal=False``: each query sees its whole sequence (``kernels/interface.py``);
        ``attention_chunk`` C: no key before the query's chunk start ``q // C * C``.
        ``k_scale``/``v_scale``: the caches hold codes, read back as ``code * scale``."""
        check_attention_chunk(attention_chunk, causal)
        plain = softcap is None and sinks is None  # the C kernel has neither
        scales = None if k_scale is None or v_scale is None else (k_scale, v_scale)
        if plain and self._decodes_in_place(q, k_cache, v_cache, seq_lens, scales):
            return self.decode_kernel.attend(
                q,
                k_cache,
                v_cache,
                block_tables=block_tables,
                seq_lens=seq_lens,
                scale=scale,
                sliding_window=sliding_window,
                scales=scales,
                attention_chunk=attention_chunk,
            )
        key = (cu_seqlens_q, seq_lens, block_tables, q.shape[0], sliding_window, causal)
        key += (attention_chunk,)
        if self._plan is None or not _same_key(key, self._plan_key):
            self._plan = AttentionPlan.build(
                cu_seqlens_q=cu_seqlens_q,
                seq_lens=seq_lens,
                block_tables=block_tables,
                block_size=k_cache.shape[1],
                num_tokens=q.shape[0],
                sliding_window=sliding_window,
                causal=causal,
                attention_chunk=attention_chunk,
            )
            self._plan_key = key
        return self._plan.run(
            q,
            k_cache,
            v_cache,
            scale,
            q.dtype,
            self.group_alone,
            softcap=softcap,
            sinks=sinks,
            scales=scales,
        )

    def _decodes_in_place(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        seq_lens: torch.Tensor,
        scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> bool:
        """Whether the C kernel takes this step: every sequence brings one token (a decode-only
        step), the tensors suit it, and the step is not one unquantized bf16 row alone, which
        keeps HF's layout so that it decodes HF's own bf16 tokens."""
        kernel = self.decode_kernel
        if kernel is None or q.shape[0] != seq_lens.shape[0]:
            return False
        if q.shape[0] == 1 and q.dtype == torch.bfloat16 and not self.group_alone and not scales:
            return False
        return kernel.supports(q, k_cache, v_cache, scales)


def _same_key(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    """Tensors compare by identity, the rest by value."""
    return len(a) == len(b) and all(
        x is y if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b)
    )
