"""The decoder body's forward on a Hugging Face model's own modules, minus HF's per-call Python.

Hugging Face's ``LlamaModel.forward`` wraps the arithmetic of each layer in Python: decorators,
keyword plumbing, a module call per norm and projection, the attention interface lookup, views
and transposes between layouts. On the 2-core CPU that cost 1.7-4.4 ms of a 20-60 ms decode
step, about 60-150 us a layer (docs/measurements/cpu-kernels.md). ``ModelBody`` runs the same
arithmetic::

    h = embed(ids);  cos, sin = rotary(h, positions)
    per layer:  q, k, v = split(qkv_proj(norm_1(h)))      (Qwen3: q_norm, k_norm per head)
                q, k    = q * cos + rotate_half(q) * sin  (one pass over q and k together)
                h       = h + o_proj(paged_attention(q, k, v))
                h       = h + down_proj(act(gate) * up)   with gate, up = split(gate_up(norm_2(h)))
    h = norm(h)

with the same torch ops on the same values in the same order (on the CPU the norms take fewer ops
that give the same bits, ``RMSNorm``), so it equals HF's forward bit for bit in every dtype
(tests/engine/model/test_model_body.py), over the flat ``[T, H, D]`` layout the paged attention
takes, with no transposes. It calls the projection modules the model holds when the runner is built
(fused or not, quantized or not, tensor-parallel shards) and reads the norms' weights, so module
swaps must come before, as ``prepare_model`` does. It runs the families of
``architecture.FAST_BODY_ARCHITECTURES``; the runner runs HF's own decoder forward for the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from paged_serve.engine.model.attention_swap import paged_attention_flat
from paged_serve.engine.model.fused_projections import FusedLinear


@dataclass(frozen=True, slots=True)
class RMSNorm:
    """An HF RMSNorm's weight and epsilon (``LlamaRMSNorm`` and its copies in the families)."""

    weight: torch.Tensor
    eps: float
    fused: bool  # the platform's F.rms_norm has HF's bits (checked on the CPU)

    @classmethod
    def of(cls, norm: nn.Module, fused: bool) -> RMSNorm:
        """``norm``'s weight and epsilon; ``fused``: ``Platform.fused_rms_norm`` of its device."""
        return cls(norm.weight, norm.variance_epsilon, fused)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """HF's values: ``weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)``, ``x32`` being x
        in fp32.

        On the CPU ``F.rms_norm`` computes the fp32 part with the same bits as HF's five ops
        (tested), in fewer ops: about 2.4 (bf16) and 5.5 (fp32) us less for a 576-wide row
        (docs/measurements/cpu-kernels.md). In fp32 it takes the weight too (the same product); in
        bf16 the weight comes after the cast, as in HF, since ``F.rms_norm`` with a bf16 weight
        rounds once where HF rounds twice. Its bits were checked on the CPU only, so other devices
        run
        ``hf_ops``."""
        if not self.fused:
            return self.hf_ops(x)
        dtype, width = x.dtype, (x.shape[-1],)
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, width, self.weight, self.eps)
        return self.weight * F.rms_norm(x.to(torch.float32), width, eps=self.eps).to(dtype)

    def hf_ops(self, x: torch.Tensor) -> torch.Tensor:
        """HF's arithmetic, op for op."""
        dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.eps)
        return self.weight * h.to(dtype)


@dataclass(frozen=True, slots=True)
class Layer:
    """What one decoder layer's forward reads, gathered once.

    ``qkv``: the fused q/k/v module, or None when ``q_proj``/``k_proj``/``v_proj`` run apart
    (tensor parallelism keeps them apart); likewise ``gate_up``.
    """

    index: int
    norm_1: RMSNorm
    norm_2: RMSNorm
    qkv: FusedLinear | None
    q_proj: nn.Module
    k_proj: nn.Module
    v_proj: nn.Module
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None
    o_proj: nn.Module
    head_dim: int
    scaling: float
    sliding_window: int | None
    gate_up: FusedLinear | None
    gate_proj: nn.Module
    up_proj: nn.Module
    act: nn.Module
    down_proj: nn.Module

    @classmethod
    def of(cls, layer: nn.Module, fused_rms_norm: bool) -> Layer:
        attn, mlp = layer.self_attn, layer.mlp
        qkv, gate_up = getattr(attn, "qkv_proj", None), getattr(mlp, "gate_up_proj", None)
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        # Qwen2/3 set sliding_window per layer; Mistral passes its config's to every layer;
        # Llama has neither.
        window = getattr(attn, "sliding_window", getattr(attn.config, "sliding_window", None))
        return cls(
            index=attn.layer_idx,
            norm_1=RMSNorm.of(layer.input_layernorm, fused_rms_norm),
            norm_2=RMSNorm.of(layer.post_attention_layernorm, fused_rms_norm),
            qkv=qkv if isinstance(qkv, FusedLinear) else None,
            q_proj=attn.q_proj,
            k_proj=attn.k_proj,
            v_proj=attn.v_proj,
            q_norm=RMSNorm.of(q_norm, fused_rms_norm) if q_norm is not None else None,
            k_norm=RMSNorm.of(k_norm, fused_rms_norm) if k_norm is not None else None,
            o_proj=attn.o_proj,
            head_dim=attn.head_dim,
            scaling=attn.scaling,
            sliding_window=window,
            gate_up=gate_up if isinstance(gate_up, FusedLinear) else None,
            gate_proj=mlp.gate_proj,
            up_proj=mlp.up_proj,
            act=mlp.act_fn,
            down_proj=mlp.down_proj,
        )

    def __call__(
        self, h: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
    ) -> torch.Tensor:
        """``h [T, hidden]`` -> the layer's output; ``cos, signed_sin [T, 1, D]`` (``_rope``)."""
        tokens, d = h.shape[0], self.head_dim
        x = self.norm_1(h)
        if self.qkv is not None and self.q_norm is None:
            q_size, k_size, _ = self.qkv.sizes
            y = self.qkv.proj(x)
            qk = _rope(y[:, : q_size + k_size].view(tokens, -1, d), cos, signed_sin)
            q, k = qk.split((q_size // d, k_size // d), dim=1)
            v = y[:, q_size + k_size :].view(tokens, -1, d)
        else:
            if self.qkv is not None:
                q, k, v = self.qkv.proj(x).split(self.qkv.sizes, dim=-1)
            else:
                q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q, k, v = (t.view(tokens, -1, d) for t in (q, k, v))
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = _rope(q, cos, signed_sin), _rope(k, cos, signed_sin)
        out = paged_attention_flat(self.index, q, k, v, self.scaling, self.sliding_window)
        h = h + self.o_proj(out.reshape(tokens, -1))
        x = self.norm_2(h)
        if self.gate_up is not None:
            gate, up = self.gate_up.proj(x).split(self.gate_up.sizes, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return h + self.down_proj(self.act(gate) * up)


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's ``apply_rotary_pos_emb`` on one ``[T, H, D]`` tensor, ``x*cos + rotate_half(x)*sin``
    with ``rotate_half(x) = [-x2, x1]``, computed as ``x*cos + [x2, x1]*[-sin1, sin2]``: a
    product's sign is exact, so this is the same value, one op cheaper (``signed_sin``)."""
    return (x * cos) + (x.roll(x.shape[-1] // 2, dims=-1) * signed_sin)


class ModelBody:
    """``body(input_ids [T], position_ids [T])`` -> the final-norm hidden states ``[T, hidden]``
    of a prepared model, inside an ``attention_context`` like HF's forward.

    ``fused_rms_norm``: the platform's ``F.rms_norm`` gives HF's bits (``Platform``)."""

    def __init__(self, model: nn.Module, *, fused_rms_norm: bool):
        inner = model.model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.norm = RMSNorm.of(inner.norm, fused_rms_norm)
        self.layers = [
            Layer.of(layer, fused_rms_norm)
            for layer in inner.layers[: inner.config.num_hidden_layers]
        ]

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        cos, sin = self.rotary(h[None], position_ids[None])  # [1, T, D] each
        cos, sin = cos[0, :, None], sin[0, :, None]  # [T, 1, D]: over every head
        half = sin.shape[-1] // 2
        signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)  # see _rope
        for layer in self.layers:
            h = layer(h, cos, signed_sin)
        return self.norm(h)
