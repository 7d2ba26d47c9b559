"""Turn last-token logits into tokens: everything between the model's logits and the step's
sampled ids, behind ``Sampler.begin(rows)`` (before the forward) and ``PendingDraw.finish``.

    begin(rows)     the rows' grammar masks start filling (engine/sample/token_mask.py)
    finish(logits)  masks waited for -> bias, penalties, min_tokens
    (engine/sample/logit_adjustments.py)
                    -> the draw: the fused Triton sampler or the eager one, mask applied
                    -> the model's own logprobs of the drawn tokens, and the top-k ones

Every row carries a seed (the request's, or one the engine drew for it) and a step (how many
tokens the request has produced), so a row's draw depends only on (seed, step) and its logits,
never on its row index or on the rest of the batch, and survives preemption unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from paged_serve.engine.platform.host_tensors import cpu_to_device, to_device
from paged_serve.engine.sample.eager_sampling import sample_eager
from paged_serve.engine.sample.logit_adjustments import adjust_logits
from paged_serve.engine.sample.token_mask import MaskFiller, PendingMask
from paged_serve.engine.sched.request import Request
from paged_serve.kernels import reference
from paged_serve.kernels.interface import FusedSample

_SEED_MASK = (1 << 63) - 1
INVALID_TOKEN = -1  # sampled for a row with no usable logit (NaN, +inf, or nothing finite)


@dataclass(frozen=True, slots=True)
class SamplingBatch:
    """Per-row parameters as tensors on the logits' device (see
    ``paged_serve.kernels.reference``)."""

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


@dataclass(frozen=True, slots=True)
class SampledRows:
    """A step's draw, still on the device: token ids ``[B]`` int64, the model's logprobs of them
    ``[B]`` fp32 (before bias, penalties and the mask), the optional top-k ``(values,
    indices)`` ``[B, k]`` of the largest ``logprobs`` any row asked for, and per row index the
    error of a row that could not sample (its token is not to be used)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    top: tuple[torch.Tensor, torch.Tensor] | None
    failed: dict[int, str]


class Sampler:
    """Samples one token per row. ``fused`` is the platform's fused draw
    (``KernelBackend.sample``), or None for the eager one; ``device`` holds the logits;
    ``eos_token_ids`` are held back while a row is short of its ``min_tokens``;
    ``fill_timeout_s`` is each row's grammar-mask budget per step."""

    def __init__(
        self,
        fused: FusedSample | None = None,
        *,
        device: torch.device | None = None,
        eos_token_ids: Sequence[int] = (),
        fill_timeout_s: float = 0.1,
    ):
        self.device = device if device is not None else torch.device("cpu")
        self.eos_token_ids = tuple(eos_token_ids)
        self.masks = MaskFiller(fill_timeout_s)
        self._fused = fused

    def begin(self, rows: list[Request], vocab_size: int) -> PendingDraw:
        """Start the step's draw for ``rows`` (call before the forward: the grammar masks fill
        meanwhile); ``vocab_size`` is the logits' width."""
        return PendingDraw(self, rows, vocab_size, self.masks.start(rows, vocab_size))

    def batch(self, rows: Sequence[Request], vocab_size: int) -> SamplingBatch:
        """The rows' sampling parameters as tensors on the device."""
        params = [r.params for r in rows]

        def tensor(data: list, dtype: torch.dtype) -> torch.Tensor:
            return to_device(data, dtype, self.device)

        return SamplingBatch(
            temperature=tensor([p.temperature for p in params], torch.float32),
            # top-k of 0 or at least the vocabulary is no top-k: never overflow the int32 row.
            top_k=tensor([min(max(p.top_k, 0), vocab_size) for p in params], torch.int32),
            top_p=tensor([p.top_p for p in params], torch.float32),
            min_p=tensor([p.min_p for p in params], torch.float32),
            seeds=tensor([r.seed for r in rows], torch.int64),
            steps=tensor([len(r.output_token_ids) for r in rows], torch.int64),
            all_greedy=all(p.greedy for p in params),
        )

    def shutdown(self) -> None:
        """Stop the mask-filling threads."""
        self.masks.shutdown()

    def draw(
        self, logits: torch.Tensor, batch: SamplingBatch, token_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits: ``[B, V]``; returns (token ids ``[B]`` int64, logprobs ``[B]`` fp32).

        token_mask: optional packed ``int32 [B, ceil(V / 32)]`` bitmask of allowed tokens (see
        ``engine/sample/token_mask.py``); the fused draw applies it inside the sampling kernel,
        the eager one with the reference first.
        A row holding a NaN or +inf, or no finite value, gets token -1 (logprob NaN) on every
        path: the engine fails that request rather than emit a token chosen from garbage.
        """
        logits = logits.float()
        if self._fused is not None and (token_mask is not None or not batch.all_greedy):
            return self._fused(
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


@dataclass(slots=True)
class PendingDraw:
    """A step's draw begun by ``Sampler.begin``: its rows and their masks being filled."""

    sampler: Sampler
    rows: list[Request]
    vocab_size: int
    masks: PendingMask

    def finish(self, logits: torch.Tensor | None) -> SampledRows | None:
        """The draw from ``logits`` ``[len(rows), V]`` (None when the step samples nothing)."""
        host_mask, late = self.masks.wait()
        if logits is None:
            return None
        sampler, rows = self.sampler, self.rows
        logits = logits.float()
        adjusted = adjust_logits(logits, rows, sampler.eos_token_ids, host_mask)
        mask = cpu_to_device(host_mask, sampler.device) if host_mask is not None else None
        tokens, logprobs = sampler.draw(adjusted, sampler.batch(rows, self.vocab_size), mask)
        if adjusted is not logits or mask is not None:
            # report the model's own logprobs, before bias, penalties and the grammar mask
            # (an INVALID_TOKEN row reads index 0: that request fails, its logprob is unused)
            safe = tokens.clamp(min=0)[:, None]
            logprobs = torch.log_softmax(logits, dim=-1).gather(1, safe).squeeze(1)
        k = max((r.params.logprobs or 0) for r in rows)
        top = torch.log_softmax(logits, dim=-1).topk(k, dim=-1) if k > 0 else None
        return SampledRows(tokens, logprobs, top, late)
