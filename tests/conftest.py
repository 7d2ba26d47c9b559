"""Shared fixtures: tiny random-weight models of each supported family, the default model,
and the Hugging Face greedy reference every equality test compares against."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator

import torch

# Kernels run under Triton's interpreter when there is no GPU; this must be set before triton
# is first imported anywhere in the test session.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.interpreter_calls import skip_repatching_inside_a_launch

    skip_repatching_inside_a_launch()  # the interpreter's calls of jit helpers, 2x faster

# Under pytest-xdist (ci/test.sh runs two workers on the two cores) each worker's torch takes one
# thread: most tests are Python-bound, and two workers of two threads each would oversubscribe
# the cores. Tests that need two threads (the CPU column-split kernels) ask for the
# ``two_threads`` fixture.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

import pytest  # noqa: E402
from transformers import (  # noqa: E402
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.integrations.moe import ExpertsInterface  # noqa: E402

from paged_serve.engine.config import EngineConfig  # noqa: E402
from paged_serve.engine.llm_engine import LLMEngine  # noqa: E402
from paged_serve.engine.model.fused_projections import fuse_projections  # noqa: E402
from paged_serve.engine.model.loader import LoadedModel  # noqa: E402
from paged_serve.engine.model.packed_weights import packable  # noqa: E402
from paged_serve.engine.platform.platform import Platform, platform_for  # noqa: E402
from paged_serve.engine.sched.block_manager import BlockManager  # noqa: E402
from tests.tp_workers import fork_tp_workers_from_a_preloaded_server  # noqa: E402

fork_tp_workers_from_a_preloaded_server()  # TP=2 engines start in 0.3 s, not 8 s

TINY_VOCAB = 512
# The dtypes whose CPU projections ``speed_up_cpu_linears`` swaps: bf16 only where this CPU's
# oneDNN packs bf16 (not on an AVX2-only CPU, where they stay nn.Linear).
SWAPPED_DTYPES = [
    torch.float32,
    pytest.param(
        torch.bfloat16,
        marks=pytest.mark.skipif(
            not packable(torch.bfloat16), reason="this CPU's oneDNN has no bf16 path"
        ),
    ),
]

TINY_FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}


def tiny_model(family: str, seed: int = 0, vocab_size: int = TINY_VOCAB) -> PreTrainedModel:
    """A 2-layer GQA model (4 query heads, 2 KV heads, head_dim 64) with random weights.

    initializer_range is larger than a real model's so the logits are peaked: near-ties between
    the two best tokens would make greedy comparisons hinge on float rounding.
    """
    config_cls, model_cls = TINY_FAMILIES[family]
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        initializer_range=0.1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return model_cls(config).eval()


def quantized_twin(
    model: PreTrainedModel, quantize: Callable[[torch.nn.Module, Platform], int]
) -> PreTrainedModel:
    """A copy of ``model`` with the engine's fused projections quantized by ``quantize(model,
    platform)`` (``quantize_int8`` or ``quantize_int4``), under HF's own attention: the reference
    that isolates the quantization's own approximation."""
    twin = copy.deepcopy(model)
    fuse_projections(twin)
    quantize(twin, platform_for(torch.device("cpu")))
    return twin


def _quantized_experts_reference(module, hidden_states, top_k_index, top_k_weights):
    """HF's eager experts loop, each chosen expert multiplied through its quantized form
    (``linear(x, e, bias)``): the experts of a ``quantized_twin`` (transformers' own experts
    implementations index float weights)."""
    out = torch.zeros_like(hidden_states)
    for expert in top_k_index.unique().tolist():
        token, slot = torch.where(top_k_index == expert)
        b1 = module.gate_up_proj_bias[expert] if module.has_bias else None
        b2 = module.down_proj_bias[expert] if module.has_bias else None
        h = module.gate_up_proj.linear(hidden_states[token], expert, b1)
        y = module.down_proj.linear(module._apply_gate(h), expert, b2)
        out.index_add_(0, token, y * top_k_weights[token, slot, None])
    return out


QUANTIZED_EXPERTS_REFERENCE = "quantized_reference"
ExpertsInterface.register(QUANTIZED_EXPERTS_REFERENCE, _quantized_experts_reference)


def loaded(model: PreTrainedModel, name: str = "tiny") -> LoadedModel:
    """Wrap a private copy of ``model`` for the engine (the swap must not touch the reference)."""
    return LoadedModel(
        model=copy.deepcopy(model),
        tokenizer=None,
        name=name,
        eos_token_ids=(),
        max_model_len=int(model.config.max_position_embeddings),
        load_seconds=0.0,
    )


def tokenizer_engine(tokenizer: object, seed: int, **config: object) -> LLMEngine:
    """An engine on a random-weight Llama over ``tokenizer``'s vocabulary (EOS id 2, 1024
    positions), with ``config`` (kv_cache_memory 8 MiB, max_num_seqs 8 unless given)."""

    model = tiny_model("llama", seed=seed, vocab_size=len(tokenizer))
    wrapped = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name="tiny-random",
        eos_token_ids=(2,),
        max_model_len=1024,
        load_seconds=0.0,
    )
    settings = {"kv_cache_memory": 8 << 20, "max_num_seqs": 8, **config}
    return LLMEngine(EngineConfig(**settings), loaded=wrapped)


@torch.inference_mode()
def hf_greedy(
    model: PreTrainedModel, prompt: list[int], max_new_tokens: int, **generation: float
) -> list[int]:
    """Hugging Face ``generate`` greedy tokens for one prompt, alone, no EOS stop.

    ``generation``: more ``GenerationConfig`` fields, e.g. ``repetition_penalty=1.8``.
    """
    ids = torch.tensor([prompt])
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        **generation,
    )
    # generate() fills an unset eos_token_id from the model's own generation config (the tiny
    # configs say 2), which would end the reference at that token: clear it for the call.
    saved_eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    finally:
        model.generation_config.eos_token_id = saved_eos
    return out[0, len(prompt) :].tolist()


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = TINY_VOCAB) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def assert_pool_clean(bm: BlockManager) -> None:
    """After a scenario: the pool is consistent and no live request holds a block (or, for a
    hybrid model, a state slot)."""
    bm.check_integrity()
    assert bm.usage().used_blocks == 0
    if bm.state_slots is not None:
        assert bm.state_slots.num_free == bm.state_slots.num_slots
        assert not bm.state_slots.pending_copies


@pytest.fixture
def two_threads() -> Iterator[None]:
    """torch at two threads (what the CPU kernels split over), restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session", params=sorted(TINY_FAMILIES))
def tiny_family(request: pytest.FixtureRequest) -> tuple[str, PreTrainedModel]:
    return request.param, tiny_model(request.param)


@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    """SmolLM2-135M-Instruct in fp32 (converted once into $PAGED_SERVE_CACHE)."""
    from paged_serve.engine.model.loader import load_model

    return load_model(None, dtype=torch.float32, device=torch.device("cpu"))


@pytest.fixture(scope="session")
def default_tokenizer(default_model: LoadedModel):
    return default_model.tokenizer


@pytest.fixture(scope="session")
def hf_default_model(default_model: LoadedModel) -> PreTrainedModel:
    """A copy of the default model with Hugging Face's own attention (engines swap the shared
    model's attention for paged attention): the reference the server is compared with."""
    model = copy.deepcopy(default_model.model)
    model.set_attn_implementation("sdpa")
    return model


@torch.inference_mode()
def hf_prompt_logprobs(
    model: PreTrainedModel, prompt: list[int], top: int = 0
) -> tuple[list[float], list[list[int]]]:
    """Each prompt token's logprob given the ones before it (``log_softmax`` of one full fp32
    forward), for tokens 1.., and the ids of the ``top`` likeliest tokens at each of those."""
    logits = model(torch.tensor([prompt])).logits[0].float()
    log_probs = torch.log_softmax(logits, dim=-1)[:-1]
    values = log_probs.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    return values.tolist(), log_probs.topk(top, dim=-1).indices.tolist() if top else []
