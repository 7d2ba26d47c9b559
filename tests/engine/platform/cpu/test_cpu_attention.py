"""The CPU platform's attention: an ``AttentionPlan`` kept for all layers of a step equals a plan
derived afresh on every call, bit for bit (on every attention case the kernel tests use, across
"layers" that share one step's metadata, and from step to step), and the fp32 oracle
``paged_attention_ref`` up to rounding, causal or not (encoders). It computes in the model's
dtype, and there it equals Hugging Face's sdpa attention bit for bit."""

from __future__ import annotations

import types

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from paged_serve.engine.platform.cpu import attention_plan
from paged_serve.engine.platform.cpu.attention import PlannedTorchAttention
from paged_serve.engine.platform.cpu.attention_plan import (
    MIN_PADDING_SAVED,
    AttentionPlan,
    kv_pair,
    length_groups,
)
from paged_serve.kernels.reference import paged_attention_ref, write_kv_ref
from tests.kernels.conftest import build_paged_batch
from tests.kernels.test_paged_attention import CASES, _seqs
from tests.kernels.test_reference import _naive_attention

CPU = torch.device("cpu")


def _fresh_plan(q, k_cache, v_cache, dtype, *, scale, sliding_window=None, causal=True, **metadata):
    """A plan derived for this call alone, computing in ``dtype``."""
    plan = AttentionPlan.build(
        cu_seqlens_q=metadata["cu_seqlens_q"],
        seq_lens=metadata["seq_lens"],
        block_tables=metadata["block_tables"],
        block_size=k_cache.shape[1],
        num_tokens=q.shape[0],
        sliding_window=sliding_window,
        causal=causal,
    )
    return plan.run(q, k_cache, v_cache, scale, dtype)


def _batch(spec, heads, head_dim, block_size, dtype, seed=0):
    torch.manual_seed(seed)
    return build_paged_batch(
        _seqs(spec, block_size),
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=CPU,
    )


@pytest.mark.parametrize(
    "spec,heads,head_dim,block_size,dtype,window",
    [(c[1], c[2], c[3], c[4], c[5], c[7]) for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_a_kept_plan_equals_a_fresh_one_and_the_oracle(
    spec, heads, head_dim, block_size, dtype, window
):
    batch = _batch(spec, heads, head_dim, block_size, dtype)
    kwargs = dict(batch.kwargs(), scale=head_dim**-0.5, sliding_window=window)
    planned = PlannedTorchAttention()
    # Two layers of one step: the second reuses the plan built for the first, on other caches.
    other_k, other_v = batch.k_cache * -2, batch.v_cache * 3  # NaN stays where no token is
    for k_cache, v_cache in ((batch.k_cache, batch.v_cache), (other_k, other_v)):
        out = planned.paged_attention(batch.q, k_cache, v_cache, **kwargs)
        fresh = _fresh_plan(batch.q, k_cache, v_cache, dtype, **kwargs)
        assert out.dtype == fresh.dtype == dtype
        assert torch.equal(out, fresh)
        oracle = paged_attention_ref(batch.q, k_cache, v_cache, **kwargs)
        # fp32: rounding only; the model's lower precision stays close to the fp32 oracle
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out, oracle, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "spec,heads,head_dim,block_size,dtype,window",
    [(c[1], c[2], c[3], c[4], c[5], c[7]) for c in CASES[:6]],
    ids=[c[0] for c in CASES[:6]],
)
def test_k_and_v_in_one_allocation_gather_together_to_the_same_result(
    spec, heads, head_dim, block_size, dtype, window
):
    """The engine's K and V caches are views of one tensor: ``kv_pair`` sees that and one
    gather serves both; separate tensors take one gather each. Same numbers either way."""
    batch = _batch(spec, heads, head_dim, block_size, dtype)
    kwargs = dict(batch.kwargs(), scale=head_dim**-0.5, sliding_window=window)
    layers = torch.stack((batch.k_cache, batch.v_cache))[None].repeat(2, 1, 1, 1, 1, 1)
    k_view, v_view = layers[1, 0], layers[1, 1]  # like KVCache.layer(1)
    assert kv_pair(batch.k_cache, batch.v_cache) is None
    pair = kv_pair(k_view, v_view)
    assert pair is not None and pair.shape == (2, *k_view.shape)
    assert (pair[0].data_ptr(), pair[1].data_ptr()) == (k_view.data_ptr(), v_view.data_ptr())
    together = _fresh_plan(batch.q, k_view, v_view, dtype, **kwargs)
    apart = _fresh_plan(batch.q, batch.k_cache, batch.v_cache, dtype, **kwargs)
    assert torch.equal(together, apart)


# Chunked local attention (Llama 4): decode rows of equal and unequal contexts, prefill chunks
# that start mid-chunk and span several, a fresh prompt (which takes the mask, not is_causal).
CHUNK_SPECS = {
    "decode-equal": [(1, (2, 5)), (1, (2, 5))],
    "decode-ragged": [(1, (2, 5)), (1, (0, 3)), (1, (4, 0))],
    "mixed": [(9, (2, 7)), (1, (4, 0)), (None, (1, 4))],
    "fresh-prompt": [(None, (2, 3))],
}


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", sorted(CHUNK_SPECS))
def test_attention_chunk_steps_equal_the_oracle(kind: str, dtype: torch.dtype, window: int | None):
    """``attention_chunk`` C: a query at ``q`` sees no key before ``q // C * C`` (beside a
    window, both bounds). The plan is keyed on it: an unchunked call on the same metadata
    tensors after it gets its own plan."""
    batch = _batch(CHUNK_SPECS[kind], (8, 2), 64, 16, dtype)
    kwargs = dict(batch.kwargs(), scale=0.125, sliding_window=window)
    planned = PlannedTorchAttention()
    out = planned.paged_attention(
        batch.q, batch.k_cache, batch.v_cache, attention_chunk=8, **kwargs
    )
    plain = planned.paged_attention(batch.q, batch.k_cache, batch.v_cache, **kwargs)
    assert torch.equal(plain, _fresh_plan(batch.q, batch.k_cache, batch.v_cache, dtype, **kwargs))
    oracle = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, attention_chunk=8, **kwargs)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, oracle, rtol=tol, atol=tol)
    assert not torch.allclose(out.float(), plain.float(), atol=0.1)  # the chunks cut


def test_attention_chunk_is_refused_on_non_causal_steps():
    batch = _batch(CHUNK_SPECS["mixed"], (8, 2), 64, 16, torch.float32)
    with pytest.raises(ValueError, match="causal"):
        PlannedTorchAttention().paged_attention(
            batch.q, batch.k_cache, batch.v_cache, **batch.kwargs(), scale=0.125,
            attention_chunk=8, causal=False,
        )  # fmt: skip


# Encoder steps: whole prompts of 17, 1, 37 and 9 tokens (block size 16), decode rows beside
# them in one case (the same keys causal or not), and a chunk over a cached prefix.
NONCAUSAL_SPECS = {
    "prompts": [(None, (1, 1)), (None, (0, 1)), (None, (2, 5)), (None, (0, 9))],
    "one-prompt": [(None, (2, 5))],
    "with-decode-rows": [(None, (1, 1)), (1, (2, 3)), (None, (0, 9)), (1, (0, 30))],
    "chunk-over-prefix": [(5, (2, 0)), (None, (0, 9))],
}


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", sorted(NONCAUSAL_SPECS))
def test_non_causal_steps_equal_the_oracle(kind: str, dtype: torch.dtype, window: int | None):
    """``causal=False``: every query sees its whole sequence (``|k - q| < w`` with a window).
    The plan is keyed on it: a causal call on the same metadata tensors before and after gets
    its own plan."""
    batch = _batch(NONCAUSAL_SPECS[kind], (8, 2), 64, 16, dtype)
    kwargs = dict(batch.kwargs(), scale=0.125, sliding_window=window)
    planned = PlannedTorchAttention()
    causal = planned.paged_attention(batch.q, batch.k_cache, batch.v_cache, **kwargs)
    out = planned.paged_attention(batch.q, batch.k_cache, batch.v_cache, causal=False, **kwargs)
    again = planned.paged_attention(batch.q, batch.k_cache, batch.v_cache, **kwargs)
    assert torch.equal(again, causal)
    fresh = _fresh_plan(batch.q, batch.k_cache, batch.v_cache, dtype, causal=False, **kwargs)
    assert out.dtype == dtype and torch.equal(out, fresh)
    oracle = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, causal=False, **kwargs)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, oracle, rtol=tol, atol=tol)
    assert not torch.allclose(out.float(), causal.float(), atol=0.1)  # the cases tell them apart


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_non_causal_prompt_gets_what_hf_computes_for_it(dtype: torch.dtype) -> None:
    """One encoder prompt alone equals Hugging Face's sdpa attention of a bidirectional layer
    (``is_causal`` False, no mask) bit for bit, in bf16 too."""
    batch = _batch([(None, (2, 5))], (9, 3), 64, 16, dtype)
    out = PlannedTorchAttention().paged_attention(
        batch.q, batch.k_cache, batch.v_cache, **batch.kwargs(), scale=0.125, causal=False
    )
    slots = (batch.block_tables[0, :3].long()[:, None] * 16 + torch.arange(16)).flatten()[:37]
    keys = batch.k_cache.view(-1, 3, 64)[slots].transpose(0, 1)[None]  # [1, Hkv, L, D]
    values = batch.v_cache.view(-1, 3, 64)[slots].transpose(0, 1)[None]
    module = types.SimpleNamespace(is_causal=False, num_key_value_groups=3, training=False)
    want, _ = sdpa_attention_forward(
        module, batch.q.transpose(0, 1)[None], keys, values, None, scaling=0.125
    )
    assert torch.equal(out, want[0])


def test_a_new_step_gets_a_new_plan():
    planned = PlannedTorchAttention()
    for seed, spec in enumerate(([(1, (2, 3)), (1, (0, 5))], [(4, (1, 2)), (1, (3, 0))])):
        batch = _batch(spec, (8, 2), 64, 16, torch.float32, seed=seed)
        kwargs = dict(batch.kwargs(), scale=0.125)
        out = planned.paged_attention(batch.q, batch.k_cache, batch.v_cache, **kwargs)
        assert torch.equal(
            out, _fresh_plan(batch.q, batch.k_cache, batch.v_cache, torch.float32, **kwargs)
        )


@pytest.mark.parametrize("skip", [False, True])
def test_write_kv_equals_the_reference(skip: bool):
    torch.manual_seed(0)
    key, value = torch.randn(6, 2, 32), torch.randn(6, 2, 32)
    slots = torch.tensor([3, 17, -1 if skip else 40, 8, 63, -1 if skip else 0])
    planned = PlannedTorchAttention()
    for layer in range(2):  # the second layer reuses the slots planned for the first
        caches = [torch.zeros(4, 16, 2, 32) for _ in range(4)]
        planned.write_kv(key + layer, value, caches[0], caches[1], slot_mapping=slots)
        write_kv_ref(key + layer, value, caches[2], caches[3], slot_mapping=slots)
        assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def _hf_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Hugging Face's sdpa attention for one sequence alone, the way ``generate`` calls it:
    ``q [1, Hq, Lq, D]`` against ``k, v [1, Hkv, L, D]``, causal when Lq > 1; ``[Lq, Hq, D]``."""
    module = types.SimpleNamespace(is_causal=True, num_key_value_groups=q.shape[1] // k.shape[1])
    module.training = False
    out, _ = sdpa_attention_forward(module, q, k, v, None, scaling=scale)
    return out[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_each_sequence_gets_what_hf_computes_for_it_alone(dtype: torch.dtype) -> None:
    """A decode row alone, one fresh prompt, and the last chunk of a prompt whose start is
    cached: every row equals HF's sdpa on that sequence alone (decode rows attended together
    are grouped for speed and equal it up to rounding)."""
    torch.manual_seed(0)
    heads, kv_heads, head_dim, block_size, scale = 9, 3, 64, 16, 0.125
    length, seqs = 70, 3
    keys = torch.randn(seqs, kv_heads, length, head_dim, dtype=dtype)
    values = torch.randn(seqs, kv_heads, length, head_dim, dtype=dtype)
    per_seq = (length + block_size - 1) // block_size
    k_cache = torch.full((seqs * per_seq + 1, block_size, kv_heads, head_dim), float("nan"))
    k_cache, v_cache = k_cache.to(dtype), k_cache.clone().to(dtype)
    tables = torch.arange(1, seqs * per_seq + 1, dtype=torch.int32).view(seqs, per_seq)
    for s in range(seqs):
        slots = (tables[s].long()[:, None] * block_size + torch.arange(block_size)).flatten()
        k_cache.view(-1, kv_heads, head_dim)[slots[:length]] = keys[s].transpose(0, 1)
        v_cache.view(-1, kv_heads, head_dim)[slots[:length]] = values[s].transpose(0, 1)
    backend = PlannedTorchAttention()

    def ours(q: torch.Tensor, q_lens: list[int], rows: slice) -> torch.Tensor:
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        return backend.paged_attention(
            q,
            k_cache,
            v_cache,
            block_tables=tables[rows],
            seq_lens=torch.full((len(q_lens),), length, dtype=torch.int32),
            cu_seqlens_q=cu,
            scale=scale,
        )

    decode_q = torch.randn(seqs, heads, 1, head_dim, dtype=dtype)
    batched = ours(decode_q[:, :, 0], [1] * seqs, slice(0, seqs))
    for s in range(seqs):
        want = _hf_sdpa(decode_q[s : s + 1], keys[s : s + 1], values[s : s + 1], scale)
        assert torch.equal(ours(decode_q[s : s + 1, :, 0], [1], slice(s, s + 1)), want)
        # batched decode rows are grouped for speed: HF's values up to rounding
        torch.testing.assert_close(batched[s : s + 1], want, rtol=1e-2, atol=1e-2)
    prompt_q = torch.randn(1, heads, length, head_dim, dtype=dtype)
    want = _hf_sdpa(prompt_q, keys[:1], values[:1], scale)
    assert torch.equal(ours(prompt_q[0].transpose(0, 1), [length], slice(0, 1)), want)
    tail = 20  # the last 20 tokens as a chunk over the 50 cached before them
    got = ours(prompt_q[0, :, -tail:].transpose(0, 1), [tail], slice(0, 1))
    assert torch.equal(got, want[-tail:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_group_alone_lays_a_decode_row_alone_out_grouped(dtype: torch.dtype) -> None:
    """``group_alone`` (quantized models) attends a decode row alone as ``[1, Hkv, G, D]``, the
    layout of batched decode rows, bit for bit; HF's layout (the default) gets the same values
    up to rounding."""
    torch.manual_seed(0)
    kv_heads, group, head_dim, length, scale = 3, 3, 64, 37, 0.125
    k_cache = torch.randn(4, 16, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn(4, 16, kv_heads, head_dim, dtype=dtype)
    q = torch.randn(1, kv_heads * group, head_dim, dtype=dtype)
    tables = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    kwargs = dict(
        block_tables=tables,
        seq_lens=torch.tensor([length], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
        scale=scale,
    )
    got = PlannedTorchAttention(group_alone=True).paged_attention(q, k_cache, v_cache, **kwargs)
    slots = (tables[0].long()[:, None] * 16 + torch.arange(16)).flatten()[:length]
    keys = k_cache.view(-1, kv_heads, head_dim)[slots].transpose(0, 1)[None]  # [1, Hkv, L, D]
    values = v_cache.view(-1, kv_heads, head_dim)[slots].transpose(0, 1)[None]
    grouped = torch.nn.functional.scaled_dot_product_attention(
        q.view(1, kv_heads, group, head_dim), keys, values, scale=scale
    )
    assert torch.equal(got, grouped.view(1, kv_heads * group, head_dim))
    hf_layout = PlannedTorchAttention().paged_attention(q, k_cache, v_cache, **kwargs)
    torch.testing.assert_close(got, hf_layout, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_gathers_split_per_cache_to_the_same_values(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From SPLIT_GATHER_BYTES a cache, K and V are gathered one call each: the same tensor as
    one call over both, from the engine's K/V views of one allocation."""
    torch.manual_seed(0)
    layers = torch.randn(3, 2, 40, 16, 2, 32).to(dtype)  # [layers, K/V, blocks, slots, H, D]
    pair = kv_pair(layers[1, 0], layers[1, 1])
    blocks = torch.randint(0, 40, (5, 4))
    monkeypatch.setattr(attention_plan, "SPLIT_GATHER_BYTES", 1 << 40)
    together = attention_plan.gather_blocks(pair, blocks, 50)
    monkeypatch.setattr(attention_plan, "SPLIT_GATHER_BYTES", 0)
    apart = attention_plan.gather_blocks(pair, blocks, 50)
    assert together.shape == apart.shape == (2, 5, 50, 2, 32)
    assert torch.equal(together, apart)
    want_k = layers[1, 0][blocks].reshape(5, 64, 2, 32)[:, :50]
    assert torch.equal(apart[0], want_k)


def test_length_groups_split_decode_rows_only_where_padding_pays():
    assert length_groups([100, 90, 80]) == [[0, 1, 2]]  # close: one group
    assert length_groups([1, 15, 16, 17, 35, 80, 55]) == [[5, 6, 4, 3, 2, 1, 0]]  # too few rows
    lens = [300] * 4 + [20] * 12  # 12 rows would each pad 280 tokens
    assert length_groups(lens) == [[0, 1, 2, 3], list(range(4, 16))]
    spread = [10 + 37 * i % 400 for i in range(64)]
    groups = length_groups(spread)
    assert sorted(i for g in groups for i in g) == list(range(64))  # each row once
    assert len(groups) > 1
    for g in groups:  # each group led by its longest row, groups longest first
        assert spread[g[0]] == max(spread[i] for i in g)
    assert [spread[g[0]] for g in groups] == sorted((spread[g[0]] for g in groups), reverse=True)
    # the thresholds: half the longest and MIN_PADDING_SAVED tokens of padding
    n = MIN_PADDING_SAVED
    assert len(length_groups([2 * n, n])) == 2
    assert len(length_groups([2 * n, n + 1])) == 1  # more than half as long
    assert len(length_groups([2 * n - 2, n - 1])) == 1  # saves n - 1 tokens


@pytest.mark.parametrize("with_prefill", [False, True])
def test_decode_rows_split_by_length_match_naive_loop(with_prefill: bool):
    """Decode rows of very different lengths are attended in several groups (and a prefill
    chunk beside them in its own): every row still gets the documented attention."""
    seqs = [(1, 70)] * 3 + [(1, 3 + i) for i in range(10)]
    if with_prefill:
        seqs.insert(5, (4, 12))
    torch.manual_seed(0)
    batch = build_paged_batch(
        seqs,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=4,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    plan = AttentionPlan.build(
        cu_seqlens_q=batch.cu_seqlens_q,
        seq_lens=batch.seq_lens,
        block_tables=batch.block_tables,
        block_size=4,
        num_tokens=batch.q.shape[0],
        sliding_window=None,
    )
    decode_groups = [g for g in plan.groups if g.q_len == 1]
    assert len(decode_groups) == 2 and not plan.pure_decode
    assert [g.max_len for g in decode_groups] == [70, 12]
    assert not any(g.alone for g in decode_groups)
    out = plan.run(batch.q, batch.k_cache, batch.v_cache, 0.25)
    expected = _naive_attention(batch, scale=0.25, sliding_window=None)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap,with_sinks", [(3.0, False), (None, True), (4.0, True)])
def test_softcap_and_sinks_equal_the_oracle(dtype, softcap, with_sinks: bool) -> None:
    """Soft-capped scores and sinks take the plan's explicit path (torch's SDPA has neither),
    on every kind of group: decode rows together, a prefill chunk, a window; the C kernel
    never takes such a step."""
    spec = [(1, (3, 5)), (None, (1, 1)), (1, (0, 1)), (6, (2, 2)), (1, (1, 0))]
    batch = _batch(spec, (8, 2), 64, 16, dtype)
    sinks = torch.linspace(-1.0, 2.0, 8).to(dtype) if with_sinks else None
    kwargs = dict(batch.kwargs(), scale=0.5, sliding_window=20, softcap=softcap)
    planned = PlannedTorchAttention()
    out = planned.paged_attention(batch.q, batch.k_cache, batch.v_cache, sinks=sinks, **kwargs)
    oracle = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, sinks=sinks, **kwargs)
    # bf16: the scores are rounded to bf16 before the softmax, as HF's eager attention rounds
    # them (2^-8 of scores up to ~10: a few % of a weight), where SDPA keeps them in fp32
    tol = 1e-5 if dtype == torch.float32 else 6e-2
    torch.testing.assert_close(out, oracle, rtol=tol, atol=tol)
    decode = _batch([(1, (3, 5)), (1, (2, 1))], (8, 2), 64, 16, dtype)
    decode_kwargs = dict(decode.kwargs(), scale=0.5, softcap=softcap)
    got = planned.paged_attention(
        decode.q, decode.k_cache, decode.v_cache, sinks=sinks, **decode_kwargs
    )
    want = paged_attention_ref(
        decode.q, decode.k_cache, decode.v_cache, sinks=sinks, **decode_kwargs
    )
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
