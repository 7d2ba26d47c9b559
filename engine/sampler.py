"""Turn last-token logits into tokens: the fused Triton sampler or the eager one.

Every row carries a seed (the request's, or one the engine drew for it) and a step (how many
tokens the request has produced), so a row's draw depends only on (seed, step) and its logits,
never on its row index or on the rest of the batch, and survives preemption unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.eager_sampling import sample_eager
from kernels import reference

_SEED_MASK = (1 << 63) - 1
INVALID_TOKEN = -1  # sampled for a row with no usable logit (NaN, +inf, or nothing finite)


@dataclass(frozen=True, slots=True)
class SamplingBatch:
    """Per-row parameters as tensors on the logits' device (see ``kernels.reference``)."""

    temperature: torch.Tensor  # [B] fp32
    top_k: torch.Tensor  # [B] int32
    top_p: torch.Tensor  # [B] fp32
    min_p: torch.Tensor  # [B] fp32
    seeds: torch.Tensor  # [B] int64
    steps: torch.Tensor  # [B] int64
    all_greedy: bool


def row_uniforms(seed: int, step: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """The eager path's random numbers for one row: a generator keyed by (seed, step)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(hash((seed, step)) & _SEED_MASK)
    u = torch.rand(vocab_size, generator=gen, dtype=torch.float32)
    return u.to(device)


class Sampler:
    """Samples one token per row. ``backend`` is ``torch`` or ``triton``."""

    def __init__(self, backend: str):
        self.backend = backend
        self._triton_sample = None
        if backend == "triton":
            from kernels.sampling import sample

            self._triton_sample = sample

    def __call__(
        self, logits: torch.Tensor, batch: SamplingBatch, token_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits: ``[B, V]``; returns (token ids ``[B]`` int64, logprobs ``[B]`` fp32).

        token_mask: optional packed ``int32 [B, ceil(V / 32)]`` bitmask of allowed tokens (see
        ``engine/token_mask.py``); the triton backend applies it inside the sampling kernel,
        the torch backend with the reference first.
        A row holding a NaN or +inf, or no finite value, gets token -1 (logprob NaN) on every
        path: the engine fails that request rather than emit a token chosen from garbage.
        """
        logits = logits.float()
        if self._triton_sample is not None and (token_mask is not None or not batch.all_greedy):
            return self._triton_sample(
                logits,
                temperature=batch.temperature,
                top_k=batch.top_k,
                top_p=batch.top_p,
                min_p=batch.min_p,
                seeds=batch.seeds,
                steps=batch.steps,
                token_mask=token_mask,
            )
        if token_mask is not None:
            logits = reference.apply_token_bitmask_ref(logits, token_mask)
        if batch.all_greedy:
            return reference.greedy_ref(logits)
        vocab = logits.shape[1]
        uniforms = torch.stack(
            [
                row_uniforms(int(s), int(t), vocab, logits.device)
                for s, t in zip(batch.seeds.tolist(), batch.steps.tolist())
            ]
        )
        return sample_eager(
            logits,
            temperature=batch.temperature,
            top_k=batch.top_k,
            top_p=batch.top_p,
            min_p=batch.min_p,
            uniforms=uniforms,
        )
