"""Sampling hazards a GPU would show and the interpreter hides: top-p at bin edges, NaN rows.

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

from paged_serve.kernels.reference import greedy_ref, invalid_rows, sample_ref, sampling_keep_mask
from paged_serve.kernels.triton.sampling import sample, sampling_uniforms

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


def non_finite_batch(device):
    """16 logit rows over two vocabulary chunks, the first 8 invalid, each at T = 0 and T > 0.

    Returns ``(logits [32, V], params, invalid [32] bool)``.
    """
    vocab = 1500  # two chunks of 1024: bad entries in either chunk
    nan, inf = float("nan"), float("inf")
    gen = torch.Generator().manual_seed(17)
    logits = torch.randn(16, vocab, generator=gen) * 2
    logits[0, 5] = nan  # one NaN in the first chunk
    logits[1, 1400] = nan  # ... in the second
    logits[2] = nan  # all NaN
    logits[3, 17] = inf  # one +inf
    logits[4, [3, 1030]] = torch.tensor([inf, nan])
    logits[5] = -inf  # nothing finite
    logits[6] = -inf
    logits[6, 1200] = nan  # NaN among -inf
    logits[7, 1024:] = inf  # a whole chunk of +inf
    # Valid rows, some with -inf entries (a masked vocabulary is fine) and one finite token.
    logits[9, ::2] = -inf
    logits[10, :-1] = -inf
    logits[11, 1300] = 1e30  # huge but finite
    invalid = torch.tensor([True] * 8 + [False] * 8).repeat(2)
    logits = logits.repeat(2, 1)
    params = dict(
        temperature=torch.tensor([0.0] * 16 + [0.9] * 16),
        top_k=torch.tensor([0, 5, 0, 40] * 8, dtype=torch.int32),
        top_p=torch.tensor([1.0, 1.0, 0.8, 0.5] * 8),
        min_p=torch.tensor([0.0, 0.1] * 16),
        seeds=torch.arange(32, dtype=torch.int64) + 1000,
        steps=torch.full((32,), 5, dtype=torch.int64),
    )
    return logits.to(device), {k: v.to(device) for k, v in params.items()}, invalid.to(device)


@pytest.mark.gpu_hazard
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf - inf
def test_non_finite_rows_give_minus_one(device, interpreter_order):
    logits, params, invalid = non_finite_batch(device)
    assert torch.equal(invalid_rows(logits), invalid)
    tokens, logprobs = sample(logits, **params)
    assert (tokens[invalid] == -1).all(), tokens.tolist()
    assert logprobs[invalid].isnan().all()
    valid = ~invalid
    assert (tokens[valid] >= 0).all() and logprobs[valid].isfinite().all()

    # The reference agrees row for row, valid rows included (same uniforms).
    uniforms = sampling_uniforms(
        seeds=params["seeds"], steps=params["steps"], vocab_size=logits.shape[1]
    )
    keep_args = {k: params[k] for k in ("temperature", "top_k", "top_p", "min_p")}
    ref_tokens, ref_logprobs = sample_ref(logits, uniforms=uniforms, **keep_args)
    assert torch.equal(tokens, ref_tokens)
    assert ref_logprobs[invalid].isnan().all()
    torch.testing.assert_close(logprobs[valid], ref_logprobs[valid], atol=1e-5, rtol=1e-5)
    greedy, _ = greedy_ref(logits)
    greedy_rows = params["temperature"] == 0
    assert torch.equal(greedy[greedy_rows], tokens[greedy_rows])

    # Valid rows are unaffected by invalid neighbours: the same tokens sampled without them.
    alone, alone_logprobs = sample(logits[valid], **{k: v[valid] for k, v in params.items()})
    assert torch.equal(alone, tokens[valid])
    assert torch.equal(alone_logprobs, logprobs[valid])
