"""Bad input raises a clear ValueError, and nothing is queued or leaked."""

from __future__ import annotations

import pytest

from engine import LLM, EngineConfig, SamplingParams
from engine.model.attention_swap import install_paged_attention
from tests.conftest import assert_pool_clean, loaded, tiny_model


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(min_p=2.0), "min_p"),
        (dict(top_k=-3), "top_k"),
        (dict(logprobs=21), "logprobs"),
        (dict(stop=("",)), "stop"),
    ],
)
def test_sampling_params_reject_out_of_range_values(kwargs, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kwargs)


def test_engine_config_rejects_bad_values():
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=12)
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="cuda-magic")


@pytest.fixture(scope="module")
def llm():
    return LLM(loaded=loaded(tiny_model("llama")), kv_cache_memory=1 << 20, max_model_len=64)


@pytest.mark.parametrize(
    ("prompt", "params", "words"),
    [
        ([], SamplingParams(), "empty"),
        ([1] * 64, SamplingParams(), "context"),
        ([1] * 60, SamplingParams(max_tokens=10), "60 tokens.*max_tokens \\(10\\).*64"),
        ([1, 2, 999999], SamplingParams(), "outside the vocabulary"),
        ([1, -1], SamplingParams(), "outside the vocabulary"),
        ("text", SamplingParams(), "no tokenizer"),
    ],
)
def test_requests_that_cannot_run_are_refused(llm, prompt, params, words):
    with pytest.raises(ValueError, match=words):
        llm.generate([prompt], params)
    assert not llm.engine.has_unfinished
    assert_pool_clean(llm.engine.block_manager)


def test_a_request_larger_than_the_kv_pool_is_refused():
    model = tiny_model("llama")
    hf = model.config
    block_bytes = hf.num_hidden_layers * 2 * 16 * hf.num_key_value_heads * hf.head_dim * 4
    llm = LLM(loaded=loaded(model), kv_cache_memory=2 * block_bytes)
    with pytest.raises(ValueError, match="needs 3 KV blocks; the cache has 2"):
        llm.generate([[1] * 30], SamplingParams(max_tokens=5))


def test_unsupported_architecture_is_refused_at_load():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="unsupported architecture GPT2LMHeadModel"):
        install_paged_attention(model)
