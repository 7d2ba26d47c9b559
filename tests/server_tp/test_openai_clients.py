"""A representative subset of ``tests/server`` against the tensor-parallel engine of this
folder's conftest: completions and chat (whole and streamed, n > 1, logprobs, logit bias),
token-id prompts, prompt scoring equal to Hugging Face, grammar-constrained outputs, health and
metrics. (Seeded sampling and batching at TP > 1 are checked token for token against TP=1 in
``tests/engine/parallel/test_tensor_parallel.py``, on tiny models, where they cost far less.)

The tests are imported, so pytest runs them here with this folder's fixtures; each one checks
the block pool afterwards (``pool_clean``).
"""

from __future__ import annotations

from paged_serve.engine.async_engine import AsyncEngine
from tests.server.generation.test_prompt_scoring import test_echo_logprobs_equal_hf  # noqa: F401
from tests.server.generation.test_structured_outputs import (  # noqa: F401
    test_completions_regex_choice_and_grammar_hold_exactly,
)
from tests.server.openai.test_chat import test_n_streams_every_choice as test_chat_n_streams
from tests.server.openai.test_chat import (
    test_stream_and_non_stream_agree as test_chat_streams_agree,
)
from tests.server.openai.test_completions import (  # noqa: F401  (collected here)
    test_logit_bias_forces_a_token,
    test_logprobs,
    test_stream_and_non_stream_agree,
    test_token_id_prompts,
)
from tests.server.openai.test_models_health_metrics import (  # noqa: F401
    test_health,
    test_metrics_count_a_request,
)

__all__ = ["test_chat_n_streams", "test_chat_streams_agree"]


def test_the_engine_is_sharded(engine: AsyncEngine):
    with engine.between_steps() as e:
        assert e.tp is not None and e.runner.tp.world_size == 3
        assert e.runner.kv_cache.tensor.shape[-2] == 1  # 3 KV heads over 3 ranks
        assert all(p.is_alive() for p in e.tp.processes.values())
