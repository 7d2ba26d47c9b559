"""How far a quantized KV cache moves a model's predictions: teacher-forced over one text, each
position's top-1 token and the logprob of the text's own next token, from an engine with the
model-dtype cache and one with a quantized cache (``--kv-cache-dtype``).

Used by ``perf/engine/bench_kv_cache.py`` (figures) and tests/engine/kv/ (a loose floor)."""

from __future__ import annotations

from dataclasses import dataclass

from paged_serve.engine.llm import LLM
from paged_serve.engine.outputs import TokenLogprob
from paged_serve.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class Agreement:
    """Over ``positions`` scored tokens: the share whose top-1 token is the same under both
    caches, and the mean and largest ``|logprob_q - logprob_ref|`` of the text's own token."""

    positions: int
    top1: float
    mean_abs_logprob: float
    max_abs_logprob: float


def scored(llm: LLM, tokens: list[int]) -> list[TokenLogprob]:
    """``tokens`` teacher-forced: each position's logprob and top-1 (the first has none)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    [result] = llm.generate([tokens], params)
    return [entry for entry in result.prompt_logprobs[1:]]


def agreement(reference: LLM, quantized: LLM, tokens: list[int]) -> Agreement:
    """``quantized``'s predictions over ``tokens`` against ``reference``'s."""
    ref, got = scored(reference, tokens), scored(quantized, tokens)
    same = sum(a.top[0][0] == b.top[0][0] for a, b in zip(ref, got))
    deltas = [abs(a.logprob - b.logprob) for a, b in zip(ref, got)]
    return Agreement(len(ref), same / len(ref), sum(deltas) / len(deltas), max(deltas))
