"""vLLM's ``min_tokens``: EOS (and ``stop_token_ids``) cannot be sampled before that many
tokens, on completions and chat, streamed and not."""

from __future__ import annotations

import openai
import pytest

from paged_serve.engine.async_engine import AsyncEngine

PROMPT = "Write one word:"


def eos_bias(engine: AsyncEngine) -> dict[str, float]:
    """A logit_bias that makes every EOS token the likeliest by far."""
    return {str(t): 100.0 for t in engine.engine.eos_token_ids}


@pytest.mark.parametrize("min_tokens", [0, 5])
def test_min_tokens_holds_eos_back_on_completions(
    client: openai.OpenAI, model_name: str, engine: AsyncEngine, min_tokens: int
):
    out = client.completions.create(
        model=model_name,
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        logit_bias=eos_bias(engine),
        extra_body={"min_tokens": min_tokens},
    )
    [choice] = out.choices
    assert choice.finish_reason == "stop"
    assert out.usage.completion_tokens == min_tokens + 1  # held back, then EOS at once


def test_min_tokens_holds_eos_back_on_chat(
    client: openai.OpenAI, model_name: str, engine: AsyncEngine
):
    def run(**extra) -> tuple[int, str]:
        out = client.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=8,
            temperature=0,
            logit_bias=eos_bias(engine),
            extra_body=extra,
        )
        return out.usage.completion_tokens, out.choices[0].finish_reason

    assert run() == (1, "stop")
    assert run(min_tokens=3) == (4, "stop")
    streamed = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=8,
        temperature=0,
        logit_bias=eos_bias(engine),
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"min_tokens": 3},
    )
    assert list(streamed)[-1].usage.completion_tokens == 4
