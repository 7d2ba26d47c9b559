"""Sampling hazards a GPU would show and the interpreter hides (issue 17).

* Top-p at bin edges: the radix walk must not depend on exact float sums. Rows built so that
  top_p sits within a few hundred ulps of a nucleus boundary, where a walk that needs
  ``total - cum[d] == 0`` exactly keeps nothing and draws token 0 (a ``-inf`` token here), are
  drawn in the interpreter's sequential order and in the GPU's tree order (``gpu_order.py``).
* Rows with non-finite logits (NaN, +inf, or nothing finite) return token -1 at any
  temperature, from the kernel and the reference alike; valid rows in the same batch are
  untouched.

The ``gpu_hazard`` tests are what ``ci/gpu-check.sh`` runs as its own step on a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.reference import sampling_keep_mask
from kernels.sampling import sample

VOCAB = 1024
# Slack for the keep-set check: near a boundary kernel and reference may round either way.
MARGIN = 1e-5


def near_boundary_batch(num_logit_rows: int, ulps: int, device, seed: int = 0):
    """Rows that put top_p right at the nucleus boundary below the head token.

    Each logit row has token 0 at ``-inf``, one head token (logit 0), a cluster of 40 tokens
    just below it (logits in [-0.3, -0.2]) and a tail near -6. Its probability mass is therefore
    shared by many keys with the same leading digits, so the walk descends into bins holding
    several tokens, where a GPU's sums round differently from a sequential scan. Each row is
    repeated with top_p stepped through the ``2 * ulps + 1`` consecutive fp32 values around
    ``p(head) / sum(p)``. Returns ``(logits [R, V], params)``, ``R = rows * (2 * ulps + 1)``.
    """
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(num_logit_rows):
        x = torch.randn(VOCAB, generator=gen) - 6.0
        x[1 + i % 16] = 0.0
        cluster = torch.randperm(VOCAB - 40, generator=gen)[:40] + 40
        x[cluster] = -0.2 - 0.1 * torch.rand(40, generator=gen)
        x[0] = float("-inf")
        rows.append(x)
    logits = torch.stack(rows)
    p = torch.softmax(logits.double(), dim=-1)
    head = (p.max(-1).values / p.sum(-1)).float().numpy()
    steps = np.arange(-ulps, ulps + 1, dtype=np.int32)
    top_p = (head.view(np.int32)[:, None] + steps[None, :]).view(np.float32).reshape(-1)
    repeats = 2 * ulps + 1
    num_rows = num_logit_rows * repeats
    params = dict(
        temperature=torch.ones(num_rows),
        top_k=torch.zeros(num_rows, dtype=torch.int32),
        top_p=torch.from_numpy(top_p.copy()),
        min_p=torch.zeros(num_rows),
        seeds=torch.arange(num_rows, dtype=torch.int64),
        steps=torch.full((num_rows,), 3, dtype=torch.int64),
    )
    logits = logits.repeat_interleave(repeats, 0)
    return logits.to(device), {k: v.to(device) for k, v in params.items()}


def assert_draws_in_support(logits: torch.Tensor, params: dict, tokens: torch.Tensor) -> None:
    """Every draw has p > 0 and lies in the nucleus of a top_p larger by a relative MARGIN."""
    probs = torch.softmax(logits, dim=-1)
    drawn_p = probs.gather(1, tokens[:, None].clamp(min=0)).squeeze(1)
    outside = (tokens < 0) | ~(drawn_p > 0)
    assert not outside.any(), (
        f"{int(outside.sum())} of {len(tokens)} draws outside the support, e.g. token "
        f"{tokens[outside][:8].tolist()} at top_p {params['top_p'][outside][:8].tolist()}"
    )
    loose = {k: params[k] for k in ("temperature", "top_k", "min_p")}
    keep, _ = sampling_keep_mask(logits, top_p=params["top_p"] * (1 + MARGIN), **loose)
    assert keep.gather(1, tokens[:, None]).all()


@pytest.mark.gpu_hazard
def test_top_p_near_boundary_never_leaves_the_support(device, interpreter_order):
    logits, params = near_boundary_batch(24, 48, device)
    tokens, _ = sample(logits, **params)
    assert_draws_in_support(logits, params, tokens)
    # The sweep crosses the boundary: some rows keep the head token only, others more.
    assert tokens.unique().numel() > 24


@pytest.mark.cuda
@pytest.mark.gpu_hazard
def test_top_p_near_boundary_sweep_cuda(device):
    """The same sweep at scale on the GPU's real order: 600 rows x 257 top_p values."""
    logits, params = near_boundary_batch(600, 128, device, seed=1)
    assert logits.shape[0] > 150_000
    for chunk in torch.split(torch.arange(logits.shape[0], device=device), 32768):
        part = {k: v[chunk] for k, v in params.items()}
        tokens, _ = sample(logits[chunk], **part)
        assert_draws_in_support(logits[chunk], part, tokens)
