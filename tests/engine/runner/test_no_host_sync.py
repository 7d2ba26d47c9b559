"""A step never reads a device value on the host except the sampled ids at its end.

On a CPU we check the one sync transformers would add (packed-sequence detection in its mask
builders, skipped because ``paged_serve`` registers no mask function); on a GPU,
``torch.cuda.set_sync_debug_mode("error")`` turns any synchronising op into an error.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import transformers.masking_utils as masking_utils

from paged_serve.engine import LLM, SamplingParams
from paged_serve.engine.runner.model_runner import LaunchedStep
from tests.conftest import assert_pool_clean, loaded, random_prompts, tiny_model

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_no_mask_building_or_packed_sequence_detection(tiny_family, monkeypatch):
    _, model = tiny_family
    calls: list[str] = []

    def spy(*args, **kwargs):
        calls.append("find_packed_sequence_indices")
        return None

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", spy)
    llm = LLM(loaded=loaded(model), kv_cache_memory=2 << 20, max_num_batched_tokens=16)
    # Mixed steps (chunks plus decodes) have non-monotonic position ids: a "packed" batch.
    llm.generate(random_prompts([3, 20, 9], seed=2), PARAMS)
    assert calls == []
    assert_pool_clean(llm.engine.block_manager)


def fail_on_sync(launch: Callable[..., LaunchedStep]) -> Callable[..., LaunchedStep]:
    """``launch`` (everything but reading the sampled ids) under CUDA sync debug mode "error"."""

    def guarded(*args: object) -> LaunchedStep:
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    return guarded


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_cuda_step_syncs_only_to_read_the_sampled_ids(enforce_eager, monkeypatch):
    """Prefill, mixed and decode steps (graphs or eager), copy-on-write for n=2, penalties, the
    sampling kernel and top logprobs all run under sync debug mode "error"; only ``read()``
    syncs."""
    wrapped = loaded(tiny_model("qwen3", seed=3))
    wrapped.model.to("cuda")
    llm = LLM(
        loaded=wrapped,
        device="cuda",
        dtype="float32",
        max_num_seqs=8,
        max_num_batched_tokens=16,
        kv_cache_memory=4 << 20,
        enforce_eager=enforce_eager,
    )
    runner = llm.engine.runner
    monkeypatch.setattr(runner, "launch", fail_on_sync(runner.launch))
    prompts = random_prompts([3, 20, 9], seed=2)
    greedy = llm.generate(prompts, PARAMS)
    sampled = llm.generate(
        prompts,
        SamplingParams(
            max_tokens=4,
            temperature=0.8,
            top_k=20,
            seed=1,
            n=2,
            logprobs=2,
            frequency_penalty=0.5,
            repetition_penalty=1.2,
            ignore_eos=True,
        ),
    )
    assert [len(r.token_ids) for r in greedy + sampled] == [4] * 9
    if not enforce_eager:
        assert sum(runner.graphs.replays.values()) > 0
    assert_pool_clean(llm.engine.block_manager)
