"""paged_serve.engine.sample.eager_sampling against kernels.reference: the same keep sets, tokens
and logprobs, bit
for bit, over random mixes of every filter (rows that skip a filter next to rows that use it)."""

from __future__ import annotations

import pytest
import torch

from paged_serve.engine.sample.eager_sampling import keep_mask_eager, sample_eager
from paged_serve.engine.sample.sampler import Sampler, SamplingBatch, row_uniforms
from paged_serve.kernels.reference import nucleus_keep, sample_ref, sampling_keep_mask


def _mix(rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """Logits of several peakinesses (every fourth row on a 0.5 grid: many exact ties; every
    fifth with a masked half of the vocabulary), per-row filters, and uniforms."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.5, 1.0, 3.0, 8.0]).repeat(rows // 4 + 1)[:rows, None]
    logits = torch.randn(rows, vocab, generator=gen) * scale
    logits[1::4] = (logits[1::4] * 2).round() / 2
    logits[2::5, ::2] = float("-inf")

    def pick(options):
        return [options[i] for i in torch.randint(0, len(options), (rows,), generator=gen)]

    temperature = (torch.rand(rows, generator=gen) * 1.2 + 0.3).tolist()
    params = dict(
        temperature=torch.tensor([0.0 if i % 7 == 0 else t for i, t in enumerate(temperature)]),
        top_k=torch.tensor(
            pick([0, 0, -1, 1, 2, 5, 50, vocab // 3, vocab - 1, vocab, vocab + 3]),
            dtype=torch.int32,
        ),
        top_p=torch.tensor(pick([1.0, 1.0, 1.0, 0.95, 0.8, 0.5, 0.2, 1e-6])),
        min_p=torch.tensor(pick([0.0, 0.0, 0.02, 0.1, 0.3])),
    )
    return logits, params, torch.rand(rows, vocab, generator=gen)


@pytest.mark.parametrize(
    "rows,vocab,seed", [(64, 64, 0), (48, 1000, 1), (40, 2500, 2), (9, 49152, 3)]
)
def test_keep_sets_tokens_and_logprobs_equal_the_reference(rows, vocab, seed):
    logits, params, uniforms = _mix(rows, vocab, seed)
    keep, probs = keep_mask_eager(logits, **params)
    ref_keep, ref_probs = sampling_keep_mask(logits, **params)
    assert torch.equal(probs, ref_probs)
    assert torch.equal(keep, ref_keep)
    tokens, logprobs = sample_eager(logits, uniforms=uniforms, **params)
    ref_tokens, ref_logprobs = sample_ref(logits, uniforms=uniforms, **params)
    assert torch.equal(tokens, ref_tokens)
    assert torch.equal(logprobs, ref_logprobs)
    # The mix really mixes: rows with and without each filter, sampled and greedy.
    assert 0 < int((params["top_p"] < 1).sum()) < rows
    assert 0 < int(((params["top_k"] > 0) & (params["top_k"] < vocab)).sum()) < rows
    assert 0 < int((params["temperature"] == 0).sum()) < rows


def test_every_row_unfiltered_and_every_row_filtered():
    logits, params, uniforms = _mix(16, 3000, 4)
    for top_k, top_p in [(0, 1.0), (40, 0.9)]:
        same = {
            **params,
            "top_k": torch.full((16,), top_k, dtype=torch.int32),
            "top_p": torch.full((16,), top_p),
        }
        got = sample_eager(logits, uniforms=uniforms, **same)
        want = sample_ref(logits, uniforms=uniforms, **same)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_top_p_one_keeps_even_a_vanishing_token():
    """top_p >= 1 disables the nucleus (as in the kernel): a token of probability ~1e-11 stays,
    where a cumulative sum rounded to the total could have dropped it."""
    logits = torch.zeros(1, 1000)
    logits[0, 7] = -25.0
    params = dict(
        temperature=torch.ones(1),
        top_k=torch.zeros(1, dtype=torch.int32),
        top_p=torch.ones(1),
        min_p=torch.zeros(1),
    )
    for keep_mask in (keep_mask_eager, sampling_keep_mask):
        keep, probs = keep_mask(logits, **params)
        assert probs[0, 7] > 0 and keep.all()


def test_invalid_rows_give_minus_one():
    logits, params, uniforms = _mix(8, 500, 5)
    logits[0, 3] = float("nan")
    logits[5] = float("-inf")
    params["temperature"] = torch.full((8,), 0.8)
    tokens, logprobs = sample_eager(logits, uniforms=uniforms, **params)
    assert tokens[[0, 5]].tolist() == [-1, -1] and logprobs[[0, 5]].isnan().all()
    assert (tokens[[1, 2, 3, 4, 6, 7]] >= 0).all()


def test_the_torch_sampler_draws_the_reference_token():
    logits, params, _ = _mix(12, 2000, 6)
    seeds = torch.arange(12, dtype=torch.int64) * 1_000_003
    steps = torch.arange(12, dtype=torch.int64) % 5
    batch = SamplingBatch(
        temperature=params["temperature"],
        top_k=params["top_k"],
        top_p=params["top_p"],
        min_p=params["min_p"],
        seeds=seeds,
        steps=steps,
        all_greedy=False,
    )
    tokens, logprobs = Sampler().draw(logits, batch)
    uniforms = torch.stack(
        [row_uniforms(int(s), int(t), 2000, logits.device) for s, t in zip(seeds, steps)]
    )
    want = sample_ref(logits, uniforms=uniforms, **params)
    assert torch.equal(tokens, want[0]) and torch.equal(logprobs, want[1])


def test_the_nucleus_head_and_its_fallback_equal_the_reference(monkeypatch):
    """Rows cut inside the head, rows whose head is kept whole (sorted in full), a tie group
    across the head's end, and zeros (tokens outside a top-k set)."""
    from paged_serve.engine.sample import eager_sampling

    vocab, head = 3000, eager_sampling.NUCLEUS_HEAD
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(6, vocab, generator=gen)
    logits[0] *= 8.0  # peaky: the nucleus ends in the head
    logits[1] *= 0.1  # flat: the head is kept whole
    logits[2, : head + 100] = 5.0  # one tie group across the head's end
    logits[3, 40:] = float("-inf")  # 40 tokens left: zeros inside the head
    logits[4] = (logits[4] * 4).round()  # many ties
    probs = torch.softmax(logits, dim=-1)
    total = probs.sum(dim=-1, keepdim=True)
    whole_rows: list[int] = []  # rows cut over their whole sorted row
    cut = eager_sampling._cut_at_threshold

    def counting(p_k, total_k, top_p, head):
        if head == vocab:
            whole_rows.append(p_k.shape[0])
        return cut(p_k, total_k, top_p, head)

    monkeypatch.setattr(eager_sampling, "_cut_at_threshold", counting)
    for top_p in (0.05, 0.5, 0.9, 0.999):
        whole_rows.clear()
        top = torch.full((6,), top_p)
        got = eager_sampling.nucleus_keep_eager(probs, total, top)
        assert torch.equal(got, nucleus_keep(probs, total, top)), top_p
        assert sum(whole_rows) < 6  # some rows end in the head
        if top_p >= 0.5:
            assert sum(whole_rows) >= 1  # the flat row sorts in full


def test_the_benchmark_checks_and_prints(capsys):
    from perf.cpu import bench_sampling

    bench_sampling.main(["--vocab", "300", "--batches", "2", "--rounds", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 + len(bench_sampling.MIXES)
    assert all(line.strip().endswith("x") for line in lines[2:])
