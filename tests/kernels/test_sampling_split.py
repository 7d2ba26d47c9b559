"""The split-row sampler (``kernels/triton/sampling_split.py``) against the one-program kernel
and ``reference.sample_ref``.

Slices of 256 columns make the interpreter split small vocabularies (777 and 1000: not a
multiple of the slice, so the last slice is partial) over 4 programs per row. Rows mix greedy,
top-k, top-p, min-p and all three; rows holding NaN, +inf or nothing finite; a row with four
tokens tied at the nucleus boundary; grammar masks. Tokens must equal the one-program kernel's
(the same Philox uniforms and keep rules) and ``sample_ref``'s on the kernel's uniforms on rows
clear of float boundaries; logprobs to 1e-6; a row alone equals the row in a batch. CI's
kernel stage reruns the file in the GPU's tree reduction order (20 launches a call make the
interpreter slow, so the tests do not also loop over both orders themselves).
"""

from __future__ import annotations

import functools

import pytest
import torch

from paged_serve.kernels.reference import sample_ref, sampling_keep_mask
from paged_serve.kernels.triton.sampling import sample, sampling_uniforms
from paged_serve.kernels.triton.sampling_split import split_slices
from tests.kernels.test_sampling import _clear_of_boundaries, _keep_args, _params

VOCAB = 777
SLICE = 256


def _batch(device, vocab: int = VOCAB):
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(8, vocab, generator=gen) * 2.5
    logits[1, 400] = 30.0  # one dominant token in a middle slice
    logits[5, 3] = float("nan")
    logits[6, 700 % vocab] = float("inf")
    logits[7] = float("-inf")
    # four tied tokens around the nucleus boundary of row 4, spread over slices
    logits[4] = -4.0
    logits[4, 10] = 3.0
    logits[4, [150, 300, 450, 600]] = 2.0
    p = torch.softmax(logits[4].double(), 0)
    top_p = float(p[10] + 1.5 * p[150])
    params = _params(
        device,
        temperature=[0.9, 1.0, 0.0, 1.3, 1.0, 0.8, 0.7, 1.0],
        top_k=[0, 20, 0, 5, 0, 0, 3, 0],
        top_p=[1.0, 0.9, 1.0, 0.8, top_p, 1.0, 0.5, 0.9],
        min_p=[0.0, 0.0, 0.0, 0.05, 0.0, 0.1, 0.0, 0.0],
        seeds=[11, 12, 13, 14, 15, 16, 17, 18],
        steps=[0, 1, 2, 3, 4, 5, 6, 7],
    )
    return logits.to(device), params


@functools.cache
def _split_batch(device):
    """The batch sampled with slices of ``SLICE`` (two tests read it; interpreted, it is the
    file's slowest call). Called inside a test, so in the session's reduction order."""
    logits, params = _batch(device)
    return logits, params, sample(logits, **params, slice_len=SLICE)


def test_it_splits_the_row_as_configured():
    assert split_slices(VOCAB, SLICE) == 4 and split_slices(151936) == 38


def test_tokens_equal_the_one_program_kernel_and_the_reference(device):
    logits, params, split = _split_batch(device)
    whole = sample(logits, **params)
    assert torch.equal(split[0], whole[0])
    assert split[0][5:].tolist() == [-1, -1, -1]  # NaN, +inf, nothing finite
    ok = torch.isfinite(whole[1])
    torch.testing.assert_close(split[1][ok], whole[1][ok], atol=1e-6, rtol=1e-6)
    assert split[1][5:].isnan().all()
    uniforms = sampling_uniforms(seeds=params["seeds"], steps=params["steps"], vocab_size=VOCAB)
    ref, _ = sample_ref(logits.cpu(), **_keep_args(params), uniforms=uniforms.cpu())
    clear = _clear_of_boundaries(logits[:5].cpu(), {k: v[:5].cpu() for k, v in params.items()})
    assert clear.sum() >= 4
    assert torch.equal(split[0][:5].cpu()[clear], ref[:5][clear])
    keep, _ = sampling_keep_mask(
        logits[4:5].cpu(), **{k: v[4:5].cpu() for k, v in _keep_args(params).items()}
    )
    assert keep[0, [150, 300, 450, 600]].all()  # the tied run is kept whole (the reference)
    assert keep[0, split[0][4].item()]


def test_a_row_alone_equals_the_row_in_a_batch(device):
    logits, params, batched = _split_batch(device)
    for row in (3,):  # a row inside the batch, not its first
        alone = sample(logits[row : row + 1], **{k: v[row : row + 1] for k, v in params.items()},
                       slice_len=SLICE)  # fmt: skip
        assert alone[0].item() == batched[0][row].item()
        assert alone[1].item() == batched[1][row].item()


def test_grammar_masks_apply_in_every_slice(device):
    logits, params = _batch(device, vocab=1000)
    params = {k: v[:4] for k, v in params.items()}
    logits = logits[:4]
    allowed = torch.zeros(4, 1000, dtype=torch.bool)
    allowed[:, [5, 260, 513, 999]] = True  # one token in each of four slices
    words = torch.zeros(4, 32, dtype=torch.int64)
    for t in allowed[0].nonzero().flatten().tolist():
        words[:, t // 32] |= 1 << (t % 32)
    mask = words.to(torch.int32).to(device)  # bit 31 stays clear: no token 31 + 32k allowed
    whole = sample(logits, **params, token_mask=mask)
    split = sample(logits, **params, token_mask=mask, slice_len=256)
    assert torch.equal(split[0], whole[0])
    assert set(split[0].tolist()) <= {5, 260, 513, 999}
    torch.testing.assert_close(split[1], whole[1], atol=1e-6, rtol=1e-6)


def test_slice_len_must_be_a_power_of_two(device):
    logits, params = _batch(device)
    with pytest.raises(ValueError, match="power of two"):
        sample(logits, **params, slice_len=100)
