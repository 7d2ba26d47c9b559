"""The eager references themselves vs naive per-token loops (float64), so that comparing a
kernel with a reference means comparing it with the documented semantics.

Pure PyTorch on CPU: no Triton involved.
"""

from __future__ import annotations

import math

import pytest
import torch

from paged_serve.kernels.reference import (
    ARGMAX_CHUNK,
    copy_blocks_ref,
    first_argmax,
    paged_attention_ref,
    sample_ref,
    sampling_keep_mask,
    write_kv_ref,
)


def _naive_attention(
    batch,
    *,
    scale: float,
    sliding_window: int | None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Token by token, head by head, key by key through the block table, in float64; a
    ``softcap`` bends each score, a head's sink logit joins its softmax and is dropped."""
    q, k_cache, v_cache = batch.q.double(), batch.k_cache.double(), batch.v_cache.double()
    block_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    out = torch.zeros_like(q)
    cu = batch.cu_seqlens_q.tolist()
    for s, seq_len in enumerate(batch.seq_lens.tolist()):
        q_len = cu[s + 1] - cu[s]
        for i in range(q_len):
            token = cu[s] + i
            pos = seq_len - q_len + i
            first = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            for h in range(q.shape[1]):
                kv_head = h // group
                keys, values = [], []
                for j in range(first, pos + 1):
                    block = int(batch.block_tables[s, j // block_size])
                    keys.append(k_cache[block, j % block_size, kv_head])
                    values.append(v_cache[block, j % block_size, kv_head])
                scores = torch.stack(keys) @ q[token, h] * scale
                if softcap is not None:
                    scores = softcap * torch.tanh(scores / softcap)
                if sinks is not None:
                    scores = torch.cat((scores, sinks[h : h + 1].double()))
                probs = torch.softmax(scores, dim=0)[: len(keys)]
                out[token, h] = probs @ torch.stack(values)
    return out


@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_paged_attention_ref_matches_naive_loop(paged_batch, sliding_window, dtype):
    # Decode, a fresh prompt, a chunk over a cached prefix, an empty query, a block-edge decode.
    seqs = [(1, 9), (6, 6), (3, 11), (0, 4), (1, 8)]
    batch = paged_batch(
        seqs,
        num_q_heads=6,
        num_kv_heads=2,
        head_dim=16,
        block_size=4,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    kwargs = dict(batch.kwargs(), scale=0.25, sliding_window=sliding_window)
    out = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, **kwargs)
    assert out.dtype == dtype
    expected = _naive_attention(batch, scale=0.25, sliding_window=sliding_window)
    # fp32 math vs float64, then rounded to the input dtype (fp16: half an ulp of O(1) values).
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    # Without the max_seqlen hints the reference computes them itself.
    no_hints = dict(kwargs, max_seqlen_q=None, max_seqlen_k=None)
    assert torch.equal(paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, **no_hints), out)


@pytest.mark.parametrize("softcap,with_sinks", [(4.0, False), (None, True), (2.5, True)])
def test_softcap_and_sinks_match_naive_loop(paged_batch, softcap, with_sinks: bool) -> None:
    seqs = [(1, 9), (6, 6), (3, 11), (1, 1)]
    batch = paged_batch(
        seqs,
        num_q_heads=6,
        num_kv_heads=2,
        head_dim=16,
        block_size=4,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    sinks = torch.linspace(-2.0, 3.0, 6) if with_sinks else None
    kwargs = dict(batch.kwargs(), scale=0.5, sliding_window=5)
    out = paged_attention_ref(
        batch.q, batch.k_cache, batch.v_cache, softcap=softcap, sinks=sinks, **kwargs
    )
    expected = _naive_attention(batch, scale=0.5, sliding_window=5, softcap=softcap, sinks=sinks)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    plain = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, **kwargs)
    assert not torch.allclose(out, plain, atol=1e-3)  # the case is one where they matter


def _dense_context(cache: torch.Tensor, table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[Hkv, seq_len, D]``: a sequence's cached tokens, position by position."""
    block_size = cache.shape[1]
    rows = [cache[int(table[j // block_size]), j % block_size] for j in range(seq_len)]
    return torch.stack(rows).transpose(0, 1)


@pytest.mark.parametrize("sliding_window", [None, 1, 3])
def test_non_causal_ref_matches_sdpa_per_sequence(paged_batch, sliding_window):
    """``causal=False``: each sequence's queries against all its keys, as torch's SDPA computes
    it without a causal mask (with a window, the explicit mask ``|i - j| < w`` over positions):
    whole prompts of lengths off the block size, a one-token prompt, a chunk over a prefix."""
    seqs = [(6, 6), (1, 1), (9, 9), (3, 11)]
    batch = paged_batch(
        seqs,
        num_q_heads=6,
        num_kv_heads=2,
        head_dim=16,
        block_size=4,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    kwargs = dict(batch.kwargs(), scale=0.25, sliding_window=sliding_window)
    out = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, causal=False, **kwargs)
    cu = batch.cu_seqlens_q.tolist()
    for s, seq_len in enumerate(batch.seq_lens.tolist()):
        table = batch.block_tables[s]
        k = _dense_context(batch.k_cache, table, seq_len).double().repeat_interleave(3, 0)
        v = _dense_context(batch.v_cache, table, seq_len).double().repeat_interleave(3, 0)
        q = batch.q[cu[s] : cu[s + 1]].double().transpose(0, 1)  # [Hq, Lq, D]
        mask = None
        if sliding_window is not None:
            q_pos = torch.arange(seq_len - q.shape[1], seq_len)[:, None]
            mask = (torch.arange(seq_len)[None, :] - q_pos).abs() < sliding_window
        want = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=False, scale=0.25
        )
        got = out[cu[s] : cu[s + 1]].double().transpose(0, 1)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    causal = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, **kwargs)
    one_token = slice(cu[1], cu[2])
    assert torch.equal(out[one_token], causal[one_token])  # it sees its one key either way
    if sliding_window == 1:  # the query's own key alone, causal or not
        assert torch.equal(out, causal)
    else:
        assert not torch.allclose(out, causal, atol=1e-2)


def test_write_kv_ref_matches_naive_loop():
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(3, 4, 2, 8, generator=gen)
    v_cache = torch.randn(3, 4, 2, 8, generator=gen)
    key = torch.randn(6, 2, 8, generator=gen)
    value = torch.randn(6, 2, 8, generator=gen)
    slot_mapping = torch.tensor([11, -1, 0, 5, -1, 4])
    k_exp, v_exp = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_exp[slot // 4, slot % 4] = key[t]
            v_exp[slot // 4, slot % 4] = value[t]
    write_kv_ref(key, value, k_cache, v_cache, slot_mapping=slot_mapping)
    assert torch.equal(k_cache, k_exp) and torch.equal(v_cache, v_exp)


def test_copy_blocks_ref_matches_naive_loop():
    kv_caches = torch.randn(3, 2, 6, 4, 2, 8, generator=torch.Generator().manual_seed(0))
    mapping = [(0, 3), (5, 1), (2, 4)]
    expected = kv_caches.clone()
    for src, dst in mapping:
        for layer in range(3):
            for side in range(2):
                expected[layer, side, dst] = expected[layer, side, src]
    copy_blocks_ref(kv_caches, block_mapping=torch.tensor(mapping))
    assert torch.equal(kv_caches, expected)
    copy_blocks_ref(kv_caches, block_mapping=torch.empty(0, 2, dtype=torch.int64))
    assert torch.equal(kv_caches, expected)


def _naive_keep(logits_row, temperature, top_k, top_p, min_p) -> tuple[list[bool], float]:
    """The documented keep rule for one row, in float64 with explicit sums; also returns the
    row's smallest relative distance to a top-p / min-p decision boundary."""
    vocab = len(logits_row)
    t = temperature if temperature > 0 else 1.0
    z32 = (torch.tensor(logits_row, dtype=torch.float32) / torch.tensor(t)).tolist()
    z_max = max(z32)
    e = [math.exp(z - z_max) for z in z32]
    p = [x / sum(e) for x in e]
    k = vocab if top_k <= 0 or top_k >= vocab else top_k
    kth = sorted(z32, reverse=True)[k - 1]
    in_k = [z >= kth for z in z32]
    mass_k = sum(pi for pi, inside in zip(p, in_k) if inside)
    keep, margin = [], math.inf
    for i in range(vocab):
        above = sum(p[j] for j in range(vocab) if in_k[j] and p[j] > p[i])
        top_p_ok = above < top_p * mass_k
        min_p_ok = p[i] >= min_p * max(p)
        keep.append(in_k[i] and top_p_ok and min_p_ok)
        if in_k[i] and top_p < 1.0:
            margin = min(margin, abs(above - top_p * mass_k) / mass_k)
        if min_p > 0.0:
            margin = min(margin, abs(p[i] - min_p * max(p)) / max(p))
    return keep, margin


def _random_rows(num_rows: int, vocab: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=gen) * 2
    logits[::3] = logits[::3].round()  # ties
    temperature = torch.rand(num_rows, generator=gen) + 0.2
    temperature[::5] = 0.0
    top_k = torch.randint(-1, vocab + 2, (num_rows,), generator=gen, dtype=torch.int32)
    top_p = torch.rand(num_rows, generator=gen)
    top_p[::4] = 1.0
    min_p = torch.rand(num_rows, generator=gen) * 0.4
    min_p[1::2] = 0.0
    return logits, dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)


def test_sampling_keep_mask_matches_naive_rule():
    logits, params = _random_rows(60, 12, seed=0)
    keep, probs = sampling_keep_mask(logits, **params)
    checked = 0
    for r in range(logits.shape[0]):
        row_params = [params[n][r].item() for n in ("temperature", "top_k", "top_p", "min_p")]
        expected, margin = _naive_keep(logits[r].tolist(), *row_params)
        if margin > 1e-5:  # fp32 vs float64 can only disagree at a boundary
            checked += 1
            assert keep[r].tolist() == expected, r
    assert checked >= 50
    temp = torch.where(params["temperature"] > 0, params["temperature"], 1.0)
    torch.testing.assert_close(probs, torch.softmax(logits / temp[:, None], dim=-1))


@pytest.mark.parametrize(
    "logits,top_k,top_p,min_p,expected",
    [
        # Ties at the k-th value are all kept.
        ([3.0, 2.0, 2.0, 2.0, 1.0, 0.0], 2, 1.0, 0.0, [1, 1, 1, 1, 0, 0]),
        # p = [.535, .197, .197, .072]: the mass strictly above each tied token is .535 < .6,
        # so the whole tie group is kept although .535 + .197 > .6.
        ([2.0, 1.0, 1.0, 0.0], 0, 0.6, 0.0, [1, 1, 1, 0]),
        # Nucleus on the top-k set: renormalised over {0, 1, 2}, p = [.576, .212, .212].
        ([2.0, 1.0, 1.0, 0.0], 3, 0.5, 0.0, [1, 0, 0, 0]),
        # min-p relative to the max probability: e^-1 = .37 >= .3, e^-2 = .14 < .3.
        ([2.0, 1.0, 1.0, 0.0], 0, 1.0, 0.3, [1, 1, 1, 0]),
    ],
)
def test_sampling_keep_mask_tie_rules(logits, top_k, top_p, min_p, expected):
    keep, _ = sampling_keep_mask(
        torch.tensor([logits]),
        temperature=torch.tensor([1.0]),
        top_k=torch.tensor([top_k], dtype=torch.int32),
        top_p=torch.tensor([top_p]),
        min_p=torch.tensor([min_p]),
    )
    assert keep[0].tolist() == [bool(x) for x in expected]


@pytest.mark.parametrize("vocab", [7, 2 * ARGMAX_CHUNK, 3 * ARGMAX_CHUNK + 5, 49_152, 32_000 + 3])
def test_first_argmax_is_the_lowest_index_of_the_row_maximum(vocab: int):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab, generator=gen)
    logits[1] = logits[1].round()  # many ties, the maximum among them
    logits[2, :] = -float("inf")
    logits[2, vocab // 2] = 1.0  # one finite value among -inf
    logits[3, 0] = logits[3, -1] = 1e4  # first and last tie: the first wins
    logits[4, -1] = 1e4  # the maximum alone at the very end (the tail past whole chunks)
    if vocab > ARGMAX_CHUNK:
        logits[5, ARGMAX_CHUNK - 1] = logits[5, ARGMAX_CHUNK] = 1e4  # tie across two chunks
        logits[6, ARGMAX_CHUNK + 1] = logits[6, -1] = 1e4  # tie between a chunk and the tail
    expected = [row.index(max(row)) for row in logits.tolist()]
    assert first_argmax(logits).tolist() == expected
    assert torch.equal(first_argmax(logits), logits.argmax(dim=-1))
    assert torch.equal(first_argmax(logits[4:5]), logits[4:5].argmax(dim=-1))


def test_sample_ref_matches_naive_race():
    logits, params = _random_rows(60, 12, seed=1)
    uniforms = torch.rand(60, 12, generator=torch.Generator().manual_seed(2))
    tokens, logprobs = sample_ref(logits, uniforms=uniforms, **params)
    for r in range(logits.shape[0]):
        row = logits[r].tolist()
        row_params = [params[n][r].item() for n in ("temperature", "top_k", "top_p", "min_p")]
        if row_params[0] == 0.0:
            assert tokens[r] == row.index(max(row))  # greedy: lowest index on ties
            continue
        keep, margin = _naive_keep(row, *row_params)
        if margin <= 1e-5:
            continue
        t = row_params[0]
        z_max = max(x / t for x in row)
        race = [
            math.exp(x / t - z_max) / -math.log(u) if kept else -1.0
            for x, u, kept in zip(row, uniforms[r].tolist(), keep)
        ]
        assert tokens[r] == race.index(max(race))
    expected = torch.log_softmax(logits.double(), dim=-1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs.double(), expected, atol=1e-5, rtol=1e-6)


def test_exponential_race_draws_in_proportion_to_kept_probabilities():
    """The race picks token i with probability p_i / sum(kept p): chi-square at p = 1e-6 over
    200k draws of one row, with top-k truncation active."""
    draws, vocab = 200_000, 8
    gen = torch.Generator().manual_seed(3)
    row = torch.randn(vocab, generator=gen)
    logits = row.expand(draws, vocab)
    params = dict(
        temperature=torch.full((draws,), 0.8),
        top_k=torch.full((draws,), 6, dtype=torch.int32),
        top_p=torch.ones(draws),
        min_p=torch.zeros(draws),
    )
    tokens, _ = sample_ref(logits, uniforms=torch.rand(draws, vocab, generator=gen), **params)
    keep, probs = sampling_keep_mask(logits[:1], **{k: v[:1] for k, v in params.items()})
    keep, probs = keep[0], probs[0].double()
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert counts[~keep].sum() == 0
    expected = draws * probs[keep] / probs[keep].sum()
    chi2 = ((counts[keep] - expected) ** 2 / expected).sum()
    df = int(keep.sum()) - 1
    assert df == 5
    p_value = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), chi2 / 2)
    assert p_value > 1e-6
