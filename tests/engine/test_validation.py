"""Bad input raises a clear ValueError, and nothing is queued or leaked."""

from __future__ import annotations

import pytest
import transformers

from paged_serve.engine import LLM, EngineConfig, SamplingParams
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


REFUSED = {
    # what the engine lacks -> a tiny model that needs it
    "DeepSeek sparse attention": lambda: transformers.DeepseekV32ForCausalLM(
        transformers.DeepseekV32Config(
            num_hidden_layers=1, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
            n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
            num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, vocab_size=64,
        )
    ),  # fmt: skip
    "state-space layers are not supported yet": lambda: transformers.JambaForCausalLM(
        transformers.JambaConfig(  # Mamba-1 layers (selective scan with dt_rank)
            num_hidden_layers=2, hidden_size=64, intermediate_size=64, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=64, attn_layer_period=2, attn_layer_offset=1,
            expert_layer_period=2, expert_layer_offset=1, num_experts=2, mamba_d_state=8,
        )
    ),  # fmt: skip
    "keeps no list of decoder layers": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    ),
}


@pytest.mark.parametrize("missing", sorted(REFUSED))
def test_a_model_the_engine_cannot_serve_is_refused_naming_what_is_missing(missing: str):
    """Refused at load, before the runner allocates any KV memory, with the reason."""
    model = REFUSED[missing]().eval()
    with pytest.raises(ValueError, match=missing):
        LLM(loaded=loaded(model), kv_cache_memory=1 << 20)
