"""Decode graphs: bucketed static-buffer replays give exactly the eager engine's tokens.

On a CPU the capture is ``EagerReplay`` (the forward re-run over the same static buffers), which
checks the bucketing, the padding rows, the static inputs and the output slicing; the
``cuda``-marked tests at the end capture real ``torch.cuda.CUDAGraph``s.
"""

from __future__ import annotations

import pytest
import torch

from paged_serve.engine import LLM, SamplingParams
from paged_serve.engine.runner.decode_graphs import DecodeGraphs, EagerReplay, graph_batch_sizes
from paged_serve.engine.runner.step_inputs import StepInputs
from paged_serve.kernels.triton.paged_attention import choose_num_kv_splits
from tests.conftest import assert_pool_clean, hf_greedy, loaded, random_prompts, tiny_model
from tests.greedy_reference import (
    assert_greedy_within_tolerance,
    float64_copy,
    greedy_reference,
)

HAS_CUDA = torch.cuda.is_available()
LENGTHS = [1, 5, 15, 16, 17, 31, 40, 63, 100]
# Different lengths end requests on different steps: the batch shrinks 9 -> 1 through every bucket.
MAX_TOKENS = [3, 5, 7, 9, 11, 13, 15, 17, 20]


def greedy(max_tokens: int, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, logprobs=logprobs, ignore_eos=True
    )


def with_graphs(llm: LLM, max_batch_size: int) -> DecodeGraphs:
    """Capture emulated decode graphs into ``llm``'s runner and return them."""
    engine = llm.engine
    graphs = DecodeGraphs(
        engine.runner.model,
        engine.runner.kv_cache,
        engine.runner.backend,
        max_batch_size=max_batch_size,
        max_model_len=engine.max_model_len,
        state_cache=engine.runner.state_cache,
    )
    engine.runner.enable_decode_graphs(graphs, EagerReplay())
    return graphs


@pytest.mark.parametrize(
    ("max_batch_size", "sizes"),
    [
        (1, [1]),
        (3, [1, 2, 3]),
        (8, [1, 2, 4, 8]),
        (11, [1, 2, 4, 8, 11]),
        (33, [1, 2, 4, 8, 16, 24, 32, 33]),
    ],
)
def test_bucket_sizes(max_batch_size, sizes):
    assert graph_batch_sizes(max_batch_size) == sizes


def test_bucket_sizes_reject_zero():
    with pytest.raises(ValueError, match="max_batch_size"):
        graph_batch_sizes(0)


def test_greedy_equals_hf_through_padded_buckets(tiny_family):
    family, model = tiny_family
    prompts = random_prompts(LENGTHS, seed=1)
    want = [hf_greedy(model, p, n) for p, n in zip(prompts, MAX_TOKENS)]
    llm = LLM(loaded=loaded(model), kv_cache_memory=4 << 20, max_num_seqs=16)
    graphs = with_graphs(llm, max_batch_size=16)
    got = llm.generate(prompts, [greedy(n) for n in MAX_TOKENS])
    assert [r.token_ids for r in got] == want
    assert set(graphs.replays) >= {1, 2, 4, 8, 16}, graphs.replays  # every bucket served
    assert graphs.padded_rows > 0
    engine = llm.engine
    assert 0 < engine.num_graph_steps == sum(graphs.replays.values()) < engine.num_steps
    assert_pool_clean(llm.engine.block_manager)


def test_chunked_and_preempted_with_graphs():
    """Prefill chunks run eagerly between replays; preemption recomputes; tokens stay HF's."""
    model = tiny_model("llama", seed=2)
    prompts = random_prompts(LENGTHS, seed=3)
    want = [hf_greedy(model, p, 20) for p in prompts]
    llm = LLM(
        loaded=loaded(model),
        kv_cache_memory=12 * 16 * 2 * 2 * 2 * 64 * 4,  # 12 blocks: forces preemption
        max_num_batched_tokens=8,
        max_num_seqs=9,
    )
    graphs = with_graphs(llm, max_batch_size=9)
    assert [r.token_ids for r in llm.generate(prompts, greedy(20))] == want
    assert llm.engine.scheduler.num_preemptions > 0
    assert sum(graphs.replays.values()) > 0
    assert_pool_clean(llm.engine.block_manager)


def test_seeded_sampling_and_forks_equal_eager():
    """n=3 seeded samples (forked, copy-on-write) draw the same tokens with and without graphs."""
    model = tiny_model("qwen2", seed=5)
    prompts = random_prompts([7, 20, 33], seed=6)
    params = SamplingParams(
        max_tokens=12, temperature=0.9, top_k=40, top_p=0.9, seed=11, n=3, ignore_eos=True
    )
    eager = LLM(loaded=loaded(model), kv_cache_memory=4 << 20)
    want = [r.token_ids for r in eager.generate(prompts, params)]
    llm = LLM(loaded=loaded(model), kv_cache_memory=4 << 20, max_num_seqs=9)
    graphs = with_graphs(llm, max_batch_size=9)
    assert [r.token_ids for r in llm.generate(prompts, params)] == want
    assert graphs.replays[9] > 0  # all 9 samples decoded together
    assert_pool_clean(llm.engine.block_manager)


def test_larger_batches_run_eagerly():
    model = tiny_model("mistral", seed=7)
    prompts = random_prompts([4, 9, 12, 30, 2], seed=8)
    lengths = [3, 5, 6, 8, 10]
    want = [hf_greedy(model, p, n) for p, n in zip(prompts, lengths)]
    llm = LLM(loaded=loaded(model), kv_cache_memory=4 << 20)
    graphs = with_graphs(llm, max_batch_size=2)
    assert [r.token_ids for r in llm.generate(prompts, [greedy(n) for n in lengths])] == want
    assert set(graphs.replays) == {1, 2}  # only once the batch shrank to 2 and 1
    assert_pool_clean(llm.engine.block_manager)


def decode_step(seq_lens: list[int], tables: list[list[int]], block_size: int = 16) -> StepInputs:
    """A decode-shaped step: each sequence's newest token, written into its own blocks."""
    last = [n - 1 for n in seq_lens]
    return StepInputs(
        input_ids=[11 + i for i in range(len(seq_lens))],
        positions=last,
        slots=[t[p // block_size] * block_size + p % block_size for t, p in zip(tables, last)],
        cu_seqlens=list(range(len(seq_lens) + 1)),
        seq_lens=seq_lens,
        block_tables=tables,
        logit_rows=list(range(len(seq_lens))),
    )


def test_padding_rows_write_nothing_to_the_cache():
    """A replay of 3 rows in the 4 bucket changes exactly the 3 real slots of every layer."""
    model = tiny_model("qwen3", seed=9)
    llm = LLM(loaded=loaded(model), kv_cache_memory=1 << 20)
    graphs = with_graphs(llm, max_batch_size=4)
    cache = llm.engine.runner.kv_cache
    cache.tensor.normal_()
    before = cache.tensor.clone()
    step = decode_step([4, 20, 40], [[5], [0, 7], [3, 2, 1]], cache.block_size)
    with torch.inference_mode():
        logits = graphs.run(step)
    assert logits.shape == (3, model.config.vocab_size)
    assert graphs.replays == {4: 1} and graphs.padded_rows == 1
    flat_before = before.flatten(2, 3)  # [layers, 2, slots, Hkv, D]
    changed = (cache.tensor.flatten(2, 3) != flat_before).any(dim=(0, 1, 3, 4))
    assert changed.nonzero().flatten().tolist() == sorted(step.slots)


def test_run_rejects_what_it_cannot_hold():
    model = tiny_model("qwen3", seed=9)
    llm = LLM(loaded=loaded(model), kv_cache_memory=1 << 20, max_model_len=64)
    graphs = with_graphs(llm, max_batch_size=2)
    assert graphs.table_width == 4
    with pytest.raises(ValueError, match="a block table of 5 blocks exceeds the graphs' 4"):
        graphs.run(decode_step([5], [[0] * 5]))
    with pytest.raises(ValueError, match="no decode graph holds a batch of 3"):
        graphs.run(decode_step([1, 1, 1], [[0], [1], [2]]))
    two_tokens = StepInputs(
        input_ids=[1, 2],
        positions=[3, 4],
        slots=[3, 4],
        cu_seqlens=[0, 2],
        seq_lens=[5],
        block_tables=[[0]],
        logit_rows=[1],
    )
    assert not graphs.holds(two_tokens)
    with pytest.raises(ValueError, match="one token per sequence"):
        graphs.run(two_tokens)
    assert graphs.replays == {}


def test_triton_kernels_in_the_graph_path():
    """The kernels with the graphs' fixed launch shape (capacity-sized split-KV: 2 splits here,
    where eager steps use 1) follow float64 HF within the stated tolerance, token for token."""
    model = tiny_model("qwen3", seed=4)
    prompts = random_prompts([1, 17, 33], seed=31)
    model64 = float64_copy(model)
    refs = [greedy_reference(model64, p, 5) for p in prompts]
    llm = LLM(
        loaded=loaded(model),
        kv_cache_memory=2 << 20,
        attention_backend="triton",
        max_model_len=1024,
    )
    graphs = with_graphs(llm, max_batch_size=4)
    assert graph_splits(graphs, num_seqs=4, num_kv_heads=2) == 2
    for result, ref in zip(llm.generate(prompts, greedy(5, logprobs=1)), refs):
        assert_greedy_within_tolerance(result, ref)
    assert graphs.replays[4] > 0
    assert_pool_clean(llm.engine.block_manager)


def test_latent_attention_in_the_graph_path():
    """DeepSeek-V3's latent cache and MLA kernel through the graphs' static buffers (padding rows
    write no latent entry): HF's greedy tokens."""
    from tests.engine.model.test_model_coverage import tiny_architecture

    model = tiny_architecture("deepseek_v3")
    prompts = random_prompts([1, 17, 33], seed=31)
    want = [hf_greedy(model, p, 5) for p in prompts]
    llm = LLM(loaded=loaded(model), kv_cache_memory=2 << 20, attention_backend="triton")
    graphs = with_graphs(llm, max_batch_size=4)
    assert [r.token_ids for r in llm.generate(prompts, greedy(5))] == want
    assert graphs.replays[4] > 0
    assert_pool_clean(llm.engine.block_manager)


def graph_splits(graphs: DecodeGraphs, *, num_seqs: int, num_kv_heads: int) -> int:
    """The split-KV factor the graphs' decode steps run with (eager steps: from true lengths)."""
    return choose_num_kv_splits(
        num_seqs=num_seqs,
        num_kv_heads=num_kv_heads,
        max_seqlen_q=1,
        max_seqlen_k=graphs.max_seqlen_k,
    )


# ---------------------------------------------------------------------------------- on a GPU
def on_cuda(model: torch.nn.Module):
    """The engine's private copy of ``model``, moved to the GPU."""
    wrapped = loaded(model)
    wrapped.model.to("cuda")
    return wrapped


@pytest.mark.cuda
@pytest.mark.gpu_hazard
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_cuda_graphs_equal_eager_and_hf(family):
    """Real capture on CUDA (fp32, triton backend): graphs, eager and HF agree token for token.

    Graph steps declare the table capacity as ``max_seqlen_k``, so they split KV where eager
    steps do not, and their GEMMs run on the padded bucket: the two paths are not bit-identical.
    Each is therefore checked at every step against float64 HF within ``LOGPROB_TOL``
    (``tests/greedy_reference.py``), on data whose float64 margins exceed twice that, so token
    equality follows from a checked tolerance rather than from equal rounding.
    """
    model = tiny_model(family, seed=1)
    prompts = random_prompts(LENGTHS, seed=1)
    model64 = float64_copy(model)
    refs = [greedy_reference(model64, p, n) for p, n in zip(prompts, MAX_TOKENS)]
    params = [greedy(n, logprobs=1) for n in MAX_TOKENS]
    kwargs = dict(device="cuda", dtype="float32", max_num_seqs=16, kv_cache_memory=4 << 20)
    eager = LLM(loaded=on_cuda(model), enforce_eager=True, **kwargs)
    assert eager.engine.runner.graphs is None
    eager_results = eager.generate(prompts, params)
    del eager
    llm = LLM(loaded=on_cuda(model), **kwargs)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8, 16]
    assert graph_splits(graphs, num_seqs=1, num_kv_heads=2) > 1  # eager: 1 (contexts < 512)
    graph_results = llm.generate(prompts, params)
    for results in (eager_results, graph_results):
        for result, ref in zip(results, refs):
            assert_greedy_within_tolerance(result, ref)
    assert [r.token_ids for r in graph_results] == [r.token_ids for r in eager_results]
    assert set(graphs.replays) >= {1, 2, 4, 8, 16}
    assert_pool_clean(llm.engine.block_manager)
