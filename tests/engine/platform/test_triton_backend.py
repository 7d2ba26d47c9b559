"""The engine end to end on the triton backend (under the interpreter on a CPU): greedy tokens
equal the torch backend's and Hugging Face's; sampling and copy-on-write go through kernels."""

from __future__ import annotations

import pytest
import torch

from paged_serve.engine import LLM, SamplingParams
from tests.conftest import assert_pool_clean, hf_greedy, loaded, random_prompts, tiny_model

PROMPTS = random_prompts([1, 17, 33], seed=31)
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3", seed=4)


def test_greedy_matches_torch_backend_and_hf(model):
    triton = LLM(
        loaded=loaded(model),
        kv_cache_memory=2 << 20,
        attention_backend="triton",
        max_num_batched_tokens=24,
    )
    assert triton.engine.backend_name == "triton"
    got = [r.token_ids for r in triton.generate(PROMPTS, GREEDY)]
    torch_llm = LLM(loaded=loaded(model), kv_cache_memory=2 << 20, attention_backend="torch")
    assert got == [r.token_ids for r in torch_llm.generate(PROMPTS, GREEDY)]
    assert got == [hf_greedy(model, p, 6) for p in PROMPTS]
    assert_pool_clean(triton.engine.block_manager)


@pytest.mark.parametrize("name", ["gpt_oss", "gemma2", "deepseek_v3"])
def test_families_through_the_kernels(name: str):
    """gpt-oss (the fused-MoE kernel with biases and its clamped gate, attention sinks, sliding
    layers), Gemma 2 (soft-capped scores) and DeepSeek-V3 (the latent write and the MLA kernel
    over chunks of 24 tokens) on the triton backend: HF's greedy tokens."""
    from tests.engine.model.test_model_coverage import tiny_architecture

    hf = tiny_architecture(name)
    llm = LLM(
        loaded=loaded(hf),
        kv_cache_memory=2 << 20,
        attention_backend="triton",
        max_num_batched_tokens=24,
    )
    got = [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]
    assert got == [hf_greedy(hf, p, 6) for p in PROMPTS]
    assert_pool_clean(llm.engine.block_manager)


def test_seeded_n2_sampling_through_the_kernels(model):
    llm = LLM(loaded=loaded(model), kv_cache_memory=2 << 20, attention_backend="triton")
    params = SamplingParams(max_tokens=4, temperature=1.0, top_k=20, seed=5, n=2, ignore_eos=True)
    first = [r.token_ids for r in llm.generate([PROMPTS[1]], params)]
    again = [r.token_ids for r in llm.generate([PROMPTS[1]], params)]
    assert first == again
    single = SamplingParams(max_tokens=4, temperature=1.0, top_k=20, seed=6, ignore_eos=True)
    assert llm.generate([PROMPTS[1]], single)[0].token_ids == first[1]
    assert_pool_clean(llm.engine.block_manager)


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    """The backend choice and the launchers ask ``paged_serve.kernels.triton.runtime`` the same
    question."""
    from paged_serve.engine.platform.platform import platform_for
    from paged_serve.kernels.triton.kv_write import write_kv

    cpu = platform_for(torch.device("cpu"))
    x = torch.zeros(1, 1, 16)
    cache = torch.zeros(1, 16, 1, 16)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        cpu.kernel_backend_name("triton")
    with pytest.raises(ValueError, match="tensors on cpu need TRITON_INTERPRET=1"):
        write_kv(x, x, cache, cache, slot_mapping=torch.zeros(1, dtype=torch.int64))
    assert cpu.kernel_backend_name("auto") == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert cpu.kernel_backend_name("triton") == "triton"
