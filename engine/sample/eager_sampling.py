"""The torch sampler's draw: ``reference.sample_ref``'s tokens without the work a row skips.

``paged_serve.kernels.reference.sample_ref`` defines the draw and computes every filter for every
row: two sorts of the vocabulary and a search of each token's place among the sorted probabilities,
whether or not the row asks for top-k or top-p. On the 2-core CPU that was 10.4 ms for one row
of 49,152 tokens and 52.7 ms for 8, more than the whole greedy bf16 step at 8 streams, for
requests at the OpenAI default (temperature 1, no top-k, no top-p;
docs/measurements/cpu-kernels.md). :func:`sample_eager` returns the same tokens and logprobs, bit
for bit
(tests/engine/sample/test_eager_sampling.py), and does per row only what the row asks for:

- no filter: the softmax and the race over the whole batch, as the reference does them (min-p
  only when some row sets it);
- top-k: the k-th largest ``z`` through ``topk`` (the same value the sort puts at ``k - 1``);
- top-p: the nucleus as a threshold, found among the row's ``NUCLEUS_HEAD`` most probable tokens
  when it ends there, else over the whole sorted row (:func:`nucleus_keep_eager`), on those rows
  only.
"""

from __future__ import annotations

import torch

from paged_serve.kernels import reference

# Tokens a top-p row looks at before it falls back to sorting the whole row: a nucleus of a
# real model at temperature <= 1 usually ends well inside them.
NUCLEUS_HEAD = 256


def keep_mask_eager(
    logits: torch.Tensor,
    *,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.sampling_keep_mask``'s ``(keep [B, V] bool, probs [B, V] fp32)``.

    The same arguments; equal to the reference's on every row without NaN or +inf (rows the
    sampler returns as invalid, token -1, whatever their mask).
    """
    keep, probs = _filtered(logits, temperature, top_k, top_p, min_p)
    return (torch.ones_like(probs, dtype=torch.bool) if keep is None else keep), probs


def _filtered(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(keep, probs)`` as :func:`keep_mask_eager`, with ``keep`` None when no row filters."""
    vocab = logits.shape[1]
    z, probs = reference.scaled_logits(logits, temperature)
    keep: torch.Tensor | None = None

    k = top_k.long()
    k_rows = ((k > 0) & (k < vocab)).nonzero().squeeze(1)
    if k_rows.numel():
        keep = torch.ones_like(z, dtype=torch.bool)
        z_k, k_k = z[k_rows], k[k_rows]
        largest = torch.topk(z_k, int(k_k.max()), dim=-1).values  # sorted, as the sort's head
        keep[k_rows] = z_k >= largest.gather(1, (k_k - 1)[:, None])

    p_rows = (top_p < 1.0).nonzero().squeeze(1)
    if p_rows.numel():
        p_k = probs if keep is None else torch.where(keep, probs, torch.zeros_like(probs))
        total_k = p_k.sum(dim=-1, keepdim=True)  # over the batch, as the reference sums
        nucleus = nucleus_keep_eager(p_k[p_rows], total_k[p_rows], top_p[p_rows])
        keep = torch.ones_like(z, dtype=torch.bool) if keep is None else keep
        keep[p_rows] &= nucleus

    if bool((min_p > 0).any()):  # min_p 0 keeps every token: probs >= 0
        by_min_p = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        keep = by_min_p if keep is None else keep & by_min_p
    return keep, probs


def nucleus_keep_eager(
    p_k: torch.Tensor, total_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """``reference.nucleus_keep``: the same arguments and ``bool [R, V]`` result.

    The reference keeps a token when the mass strictly above it, a prefix sum of the sorted
    probabilities, is below ``top_p * total_k``. That mass only grows down the sorted order, so
    the kept tokens are those at or above one threshold: the last kept value. The prefix sums
    of the sorted row's head (``topk``'s ``NUCLEUS_HEAD`` largest values) are the reference's
    own, since a cumulative sum does not depend on what follows, so a row whose head holds a
    dropped value is decided there. The other rows find the threshold the same way over their
    whole sorted row, without the reference's search of every token's place.
    """
    keep, undecided = _cut_at_threshold(p_k, total_k, top_p, min(NUCLEUS_HEAD, p_k.shape[1]))
    if undecided.numel():
        whole = p_k.shape[1]  # these rows cut over their whole sorted row
        keep[undecided], _ = _cut_at_threshold(
            p_k[undecided], total_k[undecided], top_p[undecided], whole
        )
    return keep


def _cut_at_threshold(
    p_k: torch.Tensor, total_k: torch.Tensor, top_p: torch.Tensor, head: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The nucleus from the ``head`` largest values of each row: ``(keep [R, V] bool, rows
    whose head was kept whole [N] int64)``; those rows' ``keep`` is not their nucleus."""
    values = torch.topk(p_k, head, dim=-1).values  # descending, the sorted row's first ``head``
    csum = torch.cumsum(values, dim=-1)
    # Each position's tie group starts where the value last changed (a running max of indices).
    index = torch.arange(head, device=values.device).expand_as(values)
    starts_group = torch.ones_like(values, dtype=torch.bool)
    starts_group[:, 1:] = values[:, 1:] != values[:, :-1]
    group_start = torch.where(starts_group, index, 0).cummax(dim=-1).values
    above = torch.where(
        group_start > 0, csum.gather(1, (group_start - 1).clamp(min=0)), torch.zeros_like(values)
    )
    kept = above < top_p[:, None] * total_k  # True, then False: ``above`` never decreases
    num_kept = kept.sum(dim=-1)
    threshold = values.gather(1, (num_kept - 1).clamp(min=0)[:, None])
    keep = (p_k >= threshold) & (num_kept > 0)[:, None]
    whole = kept[:, -1] if head < p_k.shape[1] else torch.zeros_like(kept[:, -1])
    return keep, whole.nonzero().squeeze(1)


def sample_eager(
    logits: torch.Tensor,
    *,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.sample_ref``: the same arguments, tokens and logprobs.

    logits: ``[B, V]`` fp32; uniforms: ``[B, V]`` fp32 in (0, 1). Returns
    ``(token_ids [B] int64, logprobs [B] fp32)``; invalid rows get token -1, logprob NaN.
    """
    logits = logits.float()
    keep, probs = _filtered(logits, temperature, top_k, top_p, min_p)
    return reference.race_draw(logits, keep, probs, temperature=temperature, uniforms=uniforms)
