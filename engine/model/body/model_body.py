"""The decoder body's forward on a Hugging Face model's own modules, minus HF's per-call Python.

Hugging Face's ``LlamaModel.forward`` wraps the arithmetic of each layer in Python: decorators,
keyword plumbing, a module call per norm and projection, the attention interface lookup, views
and transposes between layouts. On the 2-core CPU that cost 1.7-4.4 ms of a 20-60 ms decode
step, about 60-150 us a layer (docs/measurements/cpu-kernels.md). ``ModelBody`` runs the same
arithmetic::

    h = embed(ids) [* embedding_multiplier];  cos, sin = rotary(h, positions)
    per layer:  q, k, v = split(qkv_proj(norm_1(h)))      (QK norms, clipping: attention.py)
                q, k    = q * cos + rotate_half(q) * sin  (one pass over q and k together)
                h       = h + o_proj(paged_attention(q, k, v))
                h       = h + down_proj(act(gate) * up)   with gate, up = split(gate_up(norm_2(h)))
                          or h + the family's mixture-of-experts block (feed_forward.py)
    h = norm(h)

(the norms' places and Granite's multipliers: layer.py) with the same torch ops on the same values
in the same order (on the CPU the norms take fewer ops that give the same bits, ``RMSNorm``), so
it equals HF's forward bit for bit in every dtype (tests/engine/model/test_model_body.py), over
the flat ``[T, H, D]`` layout the paged attention takes, with no transposes. It calls the
projection modules the model holds when the runner is built (fused or not, quantized or not,
tensor-parallel shards) and reads the norms' weights, so module swaps must come before, as
``prepare_model`` does. It runs the families of ``architecture.FAST_BODY_ARCHITECTURES``; the
runner runs HF's own decoder forward for the rest.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from paged_serve.engine.model.body.attention import Rotary, SelfAttention
from paged_serve.engine.model.body.layer import Layer
from paged_serve.engine.model.body.norms import norm_of

# Rotary modules that return one angle per pair of lanes (``D/2``) and rotate the two halves of a
# head: ``[x1 cos - x2 sin, x2 cos + x1 sin]`` (gpt-oss), which is ``rotate_half``'s rotation by
# the angles repeated over both halves, the same products and sums.
HALF_ANGLE_ROTARIES = ("GptOssRotaryEmbedding",)
# Rotary modules whose angles repeat per pair of lanes, which rotate in pairs (Cohere's).
PAIRED_ROTARIES = ("CohereRotaryEmbedding",)


class ModelBody:
    """``body(input_ids [T], position_ids [T])`` -> the final-norm hidden states ``[T, hidden]``
    of a prepared model, inside an ``attention_context`` like HF's forward.

    ``fused_rms_norm``: the platform's ``F.rms_norm`` gives HF's bits (``Platform``)."""

    def __init__(self, model: nn.Module, *, fused_rms_norm: bool):
        inner = model.model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.norm = norm_of(inner.norm, fused_rms_norm)
        self.embedding_scale: float | None = getattr(inner, "embedding_multiplier", None)
        config = inner.config
        self.layers = [
            Layer.of(layer, fused_rms_norm) for layer in inner.layers[: config.num_hidden_layers]
        ]
        # Gemma 3 rotates its sliding and full layers by different rotary embeddings, one module
        # taking the layer type; every other family one embedding for all layers.
        per_type = "layer_type" in inspect.signature(self.rotary.forward).parameters
        self.half_angles = type(self.rotary).__name__ in HALF_ANGLE_ROTARIES
        self.paired = type(self.rotary).__name__ in PAIRED_ROTARIES
        # Latent attention rotates inside its own module: no cos and sin of ours to make.
        self.rotates = any(isinstance(layer.attention, SelfAttention) for layer in self.layers)
        self.rope_keys: list[str | None] = (
            list(config.layer_types[: len(self.layers)]) if per_type else [None] * len(self.layers)
        )
        self.rope_groups = tuple(dict.fromkeys(self.rope_keys))  # each key once, in order

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        if self.embedding_scale is not None:  # Granite
            h = h * self.embedding_scale
        ropes = {key: self._rope(h, position_ids, key) for key in self.rope_groups}
        for layer, key in zip(self.layers, self.rope_keys):
            h = layer(h, ropes[key])
        return self.norm(h)

    def _rope(self, h: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None) -> Rotary:
        """The step's ``Rotary`` for the layers of ``layer_type`` (``cos, signed_sin [T, 1, D]``,
        over every head; ``attention.rope``)."""
        extra = () if layer_type is None else (layer_type,)
        raw = self.rotary(h[None], position_ids[None], *extra)
        if not self.rotates:
            return Rotary(None, None, raw, position_ids)
        cos, sin = raw  # [1, T, D] each
        cos, sin = cos[0, :, None], sin[0, :, None]
        if self.half_angles:
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        if self.paired:
            signed_sin = torch.stack((-sin[..., 0::2], sin[..., 1::2]), dim=-1).flatten(-2)
            return Rotary(cos, signed_sin, raw, position_ids, interleaved=True)
        half = sin.shape[-1] // 2
        signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return Rotary(cos, signed_sin, raw, position_ids)
