"""The kernel interface: the calls a step makes, which every kernel backend implements.

A backend is a set of functions (``engine/platform/kernel_backend.py``): the Triton kernels
(``kernels/triton/``), the eager references (``kernels/reference.py``) and the CPU platform's
planned attention (``engine/platform/cpu/attention.py``). Each is typed here once, as a callable
``Protocol``; an implementation may take further keyword arguments, with defaults
(tests/kernels/test_interface.py checks every backend against these signatures).

Shapes: q ``[T, Hq, D]``; key/value ``[T, Hkv, D]``; k_cache, v_cache ``[num_blocks, block_size,
Hkv, D]`` (int8 or fp8 codes beside k_scale, v_scale ``[num_blocks, block_size, Hkv]`` fp32 for a
quantized cache: ``WriteKv``); block_tables ``[S, max_blocks]`` int32; seq_lens ``[S]`` int32
(context including the new tokens); cu_seqlens_q ``[S + 1]`` int32; slot_mapping ``[T]`` int64 (-1:
do not write); block_mapping ``[N, 2]`` int64 ``(src, dst)`` rows; kv_caches ``[num_layers, 2,
num_blocks, block_size, Hkv, D]`` (``[num_layers, 1, num_blocks, block_size, 1, C]`` for a latent
cache); latent_cache ``[num_blocks, block_size, C]`` with ``C = kv_lora_rank + rope_dim`` (int8
or fp8 codes beside latent_scale ``[num_blocks, block_size]`` fp32 when quantized: ``WriteLatent``).
Linear-attention state (gated DeltaNet): conv_state ``[num_slots, K - 1, C]`` and state
``[num_slots, Hv, Dk, Dv]`` fp32, one slot per live sequence; state_slots ``[S]`` int32 and
has_state ``[S]`` int32 (0: the sequence starts from zeros). The semantics are the references'
(``fused_moe_ref`` for ``FusedMoe``, ``causal_conv1d_ref``, ``gated_delta_rule_ref``,
``lora_shrink_ref`` and ``lora_expand_ref``).

Batched multi-LoRA: x ``[T, K]``; y ``[T, N]``; the adapters' matrices stacked by slot, a
``[S, R, K]`` (x's dtype) and b ``[S, R, N]`` (y's dtype); s ``[T, R]`` fp32; token_slots ``[T]``
int32, each token's adapter slot (-1: no adapter).

Experts stored quantized reach the fused MoE as ``IntExperts`` or ``Fp8Experts`` (their layouts
below; ``dequantize_experts_ref`` gives the weights they stand for).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch


@dataclass(frozen=True, slots=True)
class IntExperts:
    """One projection of every expert as 4- or 8-bit integer codes with group scales: per
    expert, the ``PackedInt`` layout of ``kernels/triton/quantized_gemm.py`` stacked::

        qweight [E, K / pack, N] int32   pack = 32 / bits codes a word, along K, low bits first
        scales  [E, G, N] fp32           G = K / group_size (group_size -1: G = 1, per channel)
        zeros   [E, G, N] uint8 | None   None: symmetric, the zero is 2^(bits-1)

        W[e, n, k] = (q[e, k, n] - zero[e, k // group_size, n]) * scale[e, k // group_size, n]

    No act-order permutation: the kernels refuse one (an expert's inputs are the hidden state
    or the gate's output, gathered once for all experts)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bits: int
    group_size: int

    @property
    def shape(self) -> torch.Size:
        """``(E, N, K)``: experts, outputs, inputs."""
        experts, rows, n = self.qweight.shape
        return torch.Size((experts, n, rows * (32 // self.bits)))

    def expert(self, e: int) -> IntExperts:
        """Expert ``e`` alone (``E = 1``; views)."""
        zeros = None if self.zeros is None else self.zeros[e : e + 1]
        return replace(
            self, qweight=self.qweight[e : e + 1], scales=self.scales[e : e + 1], zeros=zeros
        )


@dataclass(frozen=True, slots=True)
class Fp8Experts:
    """One projection of every expert as e4m3 weights ``[E, N, K]`` with fp32 scales: per block
    of ``block = (bn, bk)`` (``scale [E, ceil(N / bn), ceil(K / bk)]``: ``W = w * scale[e, n //
    bn, k // bk]``) or per output channel (``block`` None, ``scale [E, N]``)."""

    weight: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int] | None

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def expert(self, e: int) -> Fp8Experts:
        """Expert ``e`` alone (``E = 1``; views)."""
        return replace(self, weight=self.weight[e : e + 1], scale=self.scale[e : e + 1])


ExpertWeights = IntExperts | Fp8Experts


class WriteKv(Protocol):
    """Scatter a step's new keys and values into one layer's caches, in place.

    Quantized KV cache (``k_scale``, ``v_scale`` given, both or neither): the caches hold
    codes ``[num_blocks, block_size, Hkv, D]`` of dtype int8, float8_e4m3fn or float8_e5m2,
    beside scales ``[num_blocks, block_size, Hkv]`` fp32, one per token and KV head, and a
    cached value is ``code.float() * scale``. The write quantizes each token's head in fp32::

        amax  = max |x| over the D lanes
        scale = amax / QMAX            (1.0 where amax == 0: codes all zero)
        int8: code = round(x / scale)  to nearest, ties to even, within [-127, 127]
        fp8:  code = fp8(clamp(x / scale, -QMAX, QMAX))   (the cast rounds to nearest even)

    with QMAX 127 (int8), 448 (e4m3), 57344 (e5m2) (``reference.KV_QMAX``; the reference is
    ``quantize_kv_ref``). A slot of -1 gets neither codes nor a scale.
    """

    def __call__(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        *,
        slot_mapping: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None: ...


class PagedAttention(Protocol):
    """Attention of ragged query chunks over the paged cache: ``[T, Hq, D]`` in q's dtype.
    ``max_seqlen_q`` / ``max_seqlen_k``: the step's longest query chunk and context (tokens);
    ``softcap`` c: each score ``s`` (scaled) becomes ``c * tanh(s / c)`` before the mask
    (Gemma 2); ``sinks``: ``[Hq]`` fp32 logits, one per query head, that join each row's
    softmax denominator and attend to nothing (gpt-oss).

    Which keys a query sees: of the keys of its own sequence, at positions ``k`` in
    ``[0, seq_len)``, the query at position ``q`` (token ``i`` of a chunk of ``q_len`` sits at
    ``seq_len - q_len + i``) sees, with ``sliding_window`` w or without one:

    ===========================  ===================  =====================
    ``causal``                   no window            window ``w``
    ===========================  ===================  =====================
    True (decoders)              ``k <= q``           ``q - w < k <= q``
    False (encoders)             every ``k``          ``|k - q| < w``
    ===========================  ===================  =====================

    ``causal=False`` serves bidirectional encoders (BERT, XLM-RoBERTa, ModernBERT, Nomic BERT),
    whose whole prompt is one chunk (``q_len == seq_len``). Its window is ModernBERT's local
    attention: the layer passes ``w = local_attention // 2 + 1`` and Hugging Face keeps
    ``|q - k| <= local_attention // 2`` (transformers' ``sliding_window_bidirectional_overlay``),
    the same keys. A decode row (``q_len`` 1, at ``seq_len - 1``) sees the same keys either way.

    ``attention_chunk`` C (tokens; causal layers only, else ValueError): chunked local
    attention (Llama 4's ``chunked_attention`` layers), the query at ``q`` also sees no key
    before its chunk's start, ``k >= q // C * C`` (with a window, both lower bounds hold:
    ``k >= max(q - w + 1, q // C * C)``). A decode row's chunk starts at
    ``(seq_len - 1) // C * C``.

    ``k_scale``, ``v_scale`` (both or neither): the caches are quantized (``WriteKv``'s layout:
    int8/fp8 codes and fp32 ``[num_blocks, block_size, Hkv]`` scales); the attention reads
    ``code.float() * scale`` for every key and value, dequantized as each block is loaded, and
    returns q's dtype as always.
    """

    def __call__(
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
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        causal: bool = True,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        attention_chunk: int | None = None,
    ) -> torch.Tensor: ...


class WriteLatent(Protocol):
    """Scatter a step's latent cache entries ``[T, C]`` into one layer's latent cache, in place
    (multi-head latent attention).

    Quantized latent cache (``latent_scale`` given): the cache holds int8 / fp8 codes ``[num_blocks,
    block_size, C]`` beside ``latent_scale [num_blocks, block_size]`` fp32, one scale per token
    (the entry is one "KV head"), and each entry is quantized as ``WriteKv`` quantizes a head:
    ``scale = max|entry| / QMAX`` over its ``C`` lanes (``quantize_kv_ref``). A slot of -1 gets
    neither codes nor a scale.
    """

    def __call__(
        self,
        latent: torch.Tensor,
        latent_cache: torch.Tensor,
        *,
        slot_mapping: torch.Tensor,
        latent_scale: torch.Tensor | None = None,
    ) -> None: ...


class MlaAttention(Protocol):
    """Absorbed-query multi-head latent attention over the paged latent cache: ``q [T, H, C]``
    (``q_nope @ W_UK``, then the rotated rope part) in, latent outputs ``[T, H, kv_lora_rank]``
    in q's dtype out; metadata as for ``PagedAttention``. ``latent_scale [num_blocks,
    block_size]`` fp32: the cache is quantized (``WriteLatent``'s layout) and every entry read
    is ``code.float() * scale``."""

    def __call__(
        self,
        q: torch.Tensor,
        latent_cache: torch.Tensor,
        *,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        scale: float,
        kv_lora_rank: int,
        max_seqlen_q: int,
        max_seqlen_k: int,
        latent_scale: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class CopyBlocks(Protocol):
    """Copy whole blocks of every layer and side (copy-on-write of forked sequences), in place.
    Any dtype (int8 and fp8 codes too); a quantized cache's scales ``[L, sides, num_blocks,
    block_size, Hkv]`` fp32 (a latent cache's: ``[L, 1, num_blocks, block_size, 1]``) are copied
    by a second call on their ``[..., Hkv, 1]`` view."""

    def __call__(self, kv_caches: torch.Tensor, *, block_mapping: torch.Tensor) -> None: ...


class FusedSample(Protocol):
    """Draw one token per row of ``logits [B, V]``: ``(token_ids [B] int64, logprobs [B] fp32)``;
    per-row parameters ``[B]``; ``token_mask`` ``[B, ceil(V / 32)]`` int32 packed bitmask."""

    def __call__(
        self,
        logits: torch.Tensor,
        *,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
        seeds: torch.Tensor,
        steps: torch.Tensor,
        token_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class FusedMoe(Protocol):
    """``hidden [T, H]`` through its routed experts: ``[T, H]``. ``w_gate_up [E, 2I, H]``,
    ``w_down [E, H, I]`` (views of any strides, or the triton backend's quantized
    ``ExpertWeights``, the torch backend's ``QuantizedExperts`` of engine/platform/cpu/moe.py),
    ``topk_ids``/``topk_weights [T, k]``, ``apply_gate [S, 2I] -> [S, I]`` (the model's gate),
    biases ``[E, 2I]`` / ``[E, H]``."""

    def __call__(
        self,
        hidden: torch.Tensor,
        w_gate_up: torch.Tensor | ExpertWeights,
        w_down: torch.Tensor | ExpertWeights,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        apply_gate: Callable[[torch.Tensor], torch.Tensor],
        gate_up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class CausalConv(Protocol):
    """Depthwise causal convolution of ragged rows ``x [T, C]`` with ``weight [C, K]``, each
    sequence continuing from (and updating) its window in ``conv_state``; ``[T, C]``."""

    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        conv_state: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor,
        state_slots: torch.Tensor,
        has_state: torch.Tensor,
        silu: bool = True,
    ) -> torch.Tensor: ...


class GatedDeltaRule(Protocol):
    """The gated delta rule of ragged sequences over their recurrent states (updated in
    place): q, k ``[T, Hk, Dk]``, v ``[T, Hv, Dv]``, g and beta ``[T, Hv]``; ``[T, Hv, Dv]``."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor,
        state_slots: torch.Tensor,
        has_state: torch.Tensor,
        max_seqlen_q: int,
        scale: float | None = None,
    ) -> torch.Tensor: ...


class SsdScan(Protocol):
    """Mamba-2's selective state-space scan of ragged sequences over their SSM states (updated
    in place): x ``[T, H, P]``, dt ``[T, H]`` fp32 (after softplus, bias and limits), A ``[H]``
    fp32 (negative), B and C ``[T, G, N]``, D ``[H]`` or None, state ``[slots, H, P, N]`` fp32;
    ``y [T, H, P]`` in x's dtype (``kernels/reference.py``'s ``ssd_scan_ref`` defines it)."""

    def __call__(
        self,
        x: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        D: torch.Tensor | None,
        state: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor,
        state_slots: torch.Tensor,
        has_state: torch.Tensor,
        max_seqlen_q: int,
    ) -> torch.Tensor: ...


class LoraShrink(Protocol):
    """Each token's input through its adapter's A: ``s [T, R]`` fp32 with ``s[t, r] = sum_k
    x[t, k] * a[slot_t, r, k]`` summed in fp32; a row of slot -1 is zeros (and reads no a).
    ``out``: an fp32 ``[T, R]`` to write into (a CUDA graph's static buffer)."""

    def __call__(
        self,
        x: torch.Tensor,
        a: torch.Tensor,
        token_slots: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class LoraExpand(Protocol):
    """Each token's shrunk row through its adapter's B, added to ``y`` in place: ``y[t, n] +=
    sum_r s[t, r] * b[slot_t, r, n]``, the sum and the addition in fp32, stored in y's dtype;
    a row of slot -1 is left untouched, bit for bit."""

    def __call__(
        self, s: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, y: torch.Tensor
    ) -> None: ...


@dataclass(frozen=True, slots=True)
class LoraSegments:
    """A step's tokens grouped by adapter slot, for products that run slot by slot: slot
    ``first_slot + i``'s tokens are ``order[i * per_slot : (i + 1) * per_slot]`` (token indices,
    int64; a slot with fewer tokens is padded with token 0), and ``kept`` (int64 positions in
    ``order``; None: every position) are the real ones, whose token indices are ``rows``."""

    order: torch.Tensor
    per_slot: int
    kept: torch.Tensor | None
    rows: torch.Tensor


class AddLora(Protocol):
    """Each token's LoRA adapter added to a projection's output, in place:
    ``y[t] += b[s]^T (a[s] x[t])`` for the slot ``s = token_slots[t]`` of every token whose slot
    is not -1 (the Triton backend: ``LoraShrink`` then ``LoraExpand``). x ``[T, in]``; y
    ``[T, out]``; the stacked slots a ``[slots, lanes, in]`` and b ``[slots, lanes, out]``
    (``scaling * B^T`` per lane); token_slots ``[T]`` int32. The slots the tokens use lie in
    ``first_slot .. first_slot + num_slots - 1`` (host integers); ``segments`` groups the tokens
    by slot, and ``mask [T, num_slots, 1]`` (the model's dtype) is 1 where a token's slot is that
    one (a decode graph's static form of the same); both None when every token is in the one
    slot of the range."""

    def __call__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        token_slots: torch.Tensor,
        first_slot: int,
        num_slots: int,
        mask: torch.Tensor | None,
        segments: LoraSegments | None,
    ) -> None: ...
