"""The sampling kernel's grammar mask against the eager reference: the same launch samples
constrained and free rows, greedy or drawn, and never returns a token the mask disallows."""

from __future__ import annotations

import pytest
import torch

from paged_serve.kernels.reference import apply_token_bitmask_ref, sample_ref, unpack_token_bitmask
from paged_serve.kernels.triton.sampling import sample, sampling_uniforms


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """``bool [B, V]`` -> ``int32 [B, ceil(V / 32)]`` (bit ``t % 32`` of word ``t // 32``)."""
    rows, vocab = allowed.shape
    words = (vocab + 31) // 32
    padded = torch.zeros(rows, words * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    weights = 2 ** torch.arange(32, dtype=torch.int64)
    packed = (padded.view(rows, words, 32) * weights).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def params(device, rows: int, gen: torch.Generator) -> dict:
    temperature = [0.0 if i % 3 == 0 else 0.7 + 0.1 * (i % 5) for i in range(rows)]
    top_p = [1.0 if i % 4 else 0.8 for i in range(rows)]
    return dict(
        temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
        top_k=torch.tensor([0 if i % 5 else 7 for i in range(rows)], dtype=torch.int32).to(device),
        top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
        min_p=torch.zeros(rows, dtype=torch.float32, device=device),
        seeds=torch.randint(0, 2**62, (rows,), generator=gen).to(device),
        steps=torch.arange(rows, dtype=torch.int64).to(device),
    )


def test_pack_and_unpack_agree():
    gen = torch.Generator().manual_seed(0)
    allowed = torch.rand(5, 100, generator=gen) > 0.5
    assert torch.equal(unpack_token_bitmask(pack(allowed), 100), allowed)


@pytest.mark.parametrize("vocab", [70, 1500])
def test_masked_rows_match_the_reference_and_free_rows_are_untouched(device, vocab):
    rows = 24
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(device)
    allowed = torch.rand(rows, vocab, generator=gen) < 0.05  # a few tokens per row
    allowed[:, vocab - 1] = True  # the last token (a partial word when V % 32 != 0) is usable
    allowed[1::2] = True  # odd rows are free
    mask = pack(allowed).to(device)
    p = params(device, rows, gen)
    tokens, logprobs = sample(logits, token_mask=mask, **p)
    free_tokens, _ = sample(logits, **p)
    uniforms = sampling_uniforms(seeds=p["seeds"], steps=p["steps"], vocab_size=vocab)
    keep = {k: p[k] for k in ("temperature", "top_k", "top_p", "min_p")}
    ref_tokens, ref_logprobs = sample_ref(
        apply_token_bitmask_ref(logits, mask), uniforms=uniforms, **keep
    )
    assert torch.equal(tokens, ref_tokens)
    assert allowed.to(device).gather(1, tokens[:, None]).all()
    assert torch.equal(tokens[1::2], free_tokens[1::2])  # all-ones rows sample as without mask
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-5, rtol=1e-5)


def test_a_row_whose_mask_allows_nothing_is_invalid(device):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 200, generator=gen).to(device)
    allowed = torch.ones(3, 200, dtype=torch.bool)
    allowed[1] = False
    allowed[2, 150] = False
    tokens, _ = sample(logits, token_mask=pack(allowed).to(device), **params(device, 3, gen))
    assert tokens[1].item() == -1
    assert tokens[0].item() != -1 and tokens[2].item() not in (-1, 150)


def test_a_bad_mask_is_refused(device):
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 100, generator=gen).to(device)
    wrong = torch.zeros(2, 3, dtype=torch.int32, device=device)  # 100 tokens need 4 words
    with pytest.raises(ValueError, match="token_mask must be int32"):
        sample(logits, token_mask=wrong, **params(device, 2, gen))
