"""The fused sampler's draws follow the target distribution: many seeds over one row, the
empirical frequencies against the kept, renormalised target computed here independently, in
float64, from the definitions (not from ``paged_serve.kernels.reference``).

The target: ``p = softmax(logits / T)``; top-k keeps the tokens whose scaled logit is at least
the k-th largest (ties kept together); top-p keeps, among those, a token when the probability
mass of the tokens strictly more likely than it is below ``top_p`` times their total mass (ties
kept together); min-p keeps a token when ``p >= min_p * max p``. The draw is then ``p``
renormalised over the kept set.

Per case: no draw outside the kept set, and a chi-square test over the kept cells with an
expected count of at least 5 (the rest pooled into one cell), rejected below p = 1e-6 (the seeds
are fixed, so each case is deterministic; the threshold says how unlucky a correct sampler
could be). The vocabularies include ones that are not powers of two, and a row with ties at the
nucleus boundary (the kernel must keep every tied token or none). Each case with a temperature
other than 1 is also checked to have the power to fail: the same statistic rejects the
untempered distribution over the same kept set.
"""

from __future__ import annotations

import pytest
import torch

from paged_serve.kernels.triton.sampling import sample

DRAWS = 2048  # the untempered checks still reject at p < 1e-26 (v1000-T0.7-topk40)
P_REJECT = 1e-6


def target(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float):
    """``(keep [V] bool, q [V] float64)``: the kept set and the renormalised target."""
    z = logits.double() / temperature
    p = torch.softmax(z, dim=-1)
    vocab = logits.numel()
    keep = torch.ones(vocab, dtype=torch.bool)
    if 0 < top_k < vocab:
        kth = torch.sort(z, descending=True).values[top_k - 1]
        keep &= z >= kth
    if top_p < 1.0:
        p_k = torch.where(keep, p, 0.0)
        # above[i]: the mass of the tokens strictly more likely than token i ([V, V] compare)
        above = (p_k[None, :] * (p_k[None, :] > p_k[:, None])).sum(dim=1)
        keep &= above < top_p * p_k.sum()
    if min_p > 0.0:
        keep &= p >= min_p * p.max()
    q = torch.where(keep, p, 0.0)
    return keep, q / q.sum()


def chi2_pvalue(counts: torch.Tensor, q: torch.Tensor, keep: torch.Tensor) -> tuple[float, int]:
    """Chi-square p-value of ``counts`` against ``DRAWS * q`` over the kept cells, cells with
    an expected count below 5 pooled into one; and the degrees of freedom."""
    expected = DRAWS * q[keep]
    observed = counts[keep]
    big = expected >= 5
    cells_e = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    cells_o = torch.cat([observed[big], observed[~big].sum().reshape(1)])
    if cells_e[-1] < 5:  # too little pooled mass for a cell of its own: fold it in
        cells_e = torch.cat([cells_e[:-2], cells_e[-2:].sum().reshape(1)])
        cells_o = torch.cat([cells_o[:-2], cells_o[-2:].sum().reshape(1)])
    statistic = float(((cells_o - cells_e) ** 2 / cells_e).sum())
    df = cells_e.numel() - 1
    a = torch.tensor(df / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(a, torch.tensor(statistic / 2, dtype=torch.float64))), df


def _row(vocab: int, seed: int, spread: float) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * spread


def _tied_row() -> tuple[torch.Tensor, float]:
    """100 tokens: one at logit 3, four tied at 2, the rest at 0 or below; a top-p that falls
    inside the tied run, so the nucleus must hold all four tied tokens."""
    logits = torch.linspace(-2.0, 0.0, 100)
    logits[10] = 3.0
    logits[[20, 40, 60, 80]] = 2.0
    p = torch.softmax(logits.double(), dim=-1)
    top_p = float(p[10] + 1.5 * p[20])  # the second tied token crosses the threshold
    return logits, top_p


CASES = {
    # name: (logits, temperature, top_k, top_p, min_p)
    "v64-plain": (_row(64, 1, 1.0), 1.0, 0, 1.0, 0.0),
    "v1000-T0.7-topk40": (_row(1000, 2, 2.0), 0.7, 40, 1.0, 0.0),
    "v257-T1.3-topp0.9": (_row(257, 3, 1.5), 1.3, 0, 0.9, 0.0),
    "v1000-T0.5-minp0.05": (_row(1000, 4, 1.5), 0.5, 0, 1.0, 0.05),
    "v777-all": (_row(777, 5, 2.5), 0.6, 100, 0.85, 0.02),
    "ties-at-the-nucleus": (*_tied_row()[:1], 1.0, 0, _tied_row()[1], 0.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_draws_follow_the_renormalised_target(case: str, device):
    _check_draws(case, device)


@pytest.mark.cuda
@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][0].numel() > 256])
def test_split_row_draws_follow_the_renormalised_target(case: str, device):
    """The same draws through the split-row kernel, rows cut into 256-column slices (257
    columns: a last slice of one); on CUDA only (2048 rows x 20 launches would take the
    interpreter minutes; tests/kernels/test_sampling_split.py holds it to the one-program
    kernel token for token there)."""
    _check_draws(case, device, slice_len=256)


def _check_draws(case: str, device, **split: int) -> None:
    logits, temperature, top_k, top_p, min_p = CASES[case]
    vocab = logits.numel()
    keep, q = target(logits, temperature, top_k, top_p, min_p)
    tokens, _ = sample(
        logits.expand(DRAWS, vocab).contiguous().to(device),
        temperature=torch.full((DRAWS,), temperature, device=device),
        top_k=torch.full((DRAWS,), top_k, dtype=torch.int32, device=device),
        top_p=torch.full((DRAWS,), top_p, device=device),
        min_p=torch.full((DRAWS,), min_p, device=device),
        seeds=torch.full((DRAWS,), 7, dtype=torch.int64, device=device),
        steps=torch.arange(DRAWS, dtype=torch.int64, device=device),
        **split,
    )
    counts = torch.bincount(tokens.cpu(), minlength=vocab).double()
    assert counts[~keep].sum() == 0, "a token outside the kept set was drawn"
    pvalue, df = chi2_pvalue(counts, q, keep)
    assert df >= 2  # several cells: the test says something
    assert pvalue > P_REJECT, f"chi-square p = {pvalue:.3g} over {df} degrees of freedom"
    if case == "ties-at-the-nucleus":
        assert keep[[10, 20, 40, 60, 80]].all() and keep.sum() == 5
        assert (counts[[20, 40, 60, 80]] > 0).all()  # every tied token is drawn
    if temperature != 1.0:  # the power to fail: a sampler that ignored the temperature
        untempered = torch.where(keep, torch.softmax(logits.double(), dim=-1), 0.0)
        assert chi2_pvalue(counts, untempered / untempered.sum(), keep)[0] < P_REJECT
