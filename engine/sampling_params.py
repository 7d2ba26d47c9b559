"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from paged_serve.engine.grammar.structured_output import StructuredOutput

MAX_LOGPROBS = 20
MAX_N = 128
# Below these, float32 sampling degenerates (logits / T overflow; top_p * mass underflows, so
# no token is kept): such requests mean "the most likely token", as in vLLM.
MIN_TEMPERATURE = 1e-5
MIN_TOP_P = 1e-6
MAX_PENALTY = 2.0  # |presence_penalty| and |frequency_penalty|, OpenAI's range
MAX_LOGIT_BIAS = 100.0  # |bias| per token, OpenAI's range
# repetition_penalty divides positive logits and multiplies negative ones: far from 1 it only
# produces overflow (1e-300 is 0 in fp32, so logits become NaN). vLLM's useful range is (0, 2].
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 2.0
# Seeds are int64 on the device (sample i of n uses seed + i, which must stay in range too).
SEED_MIN = -(1 << 63)
SEED_MAX = (1 << 63) - 1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """What to generate and when to stop.

    temperature 0 means greedy. top_k <= 0 disables top-k; top_p 1 and min_p 0 disable theirs.
    seed makes the draws reproducible whatever else is batched with the request.
    stop strings are matched on the detokenized text and excluded from it.
    n: how many independent samples share the prompt (forked after one prefill; sample i uses
    seed + i when a seed is given).
    logprobs: how many top alternatives to report per token (None: no logprobs at all).
    presence_penalty / frequency_penalty (OpenAI's, in [-2, 2]): subtracted from the logit of
    every token already generated, once / once per occurrence. repetition_penalty (in
    [0.01, 2], 1 = off; Hugging Face's and vLLM's): divides positive and multiplies negative
    logits of every token in the prompt or the output. logit_bias: (token id, bias in
    [-100, 100]) pairs added to those tokens' logits (a dict is accepted).
    See ``engine/sample/logit_adjustments.py``.
    structured_output: a constraint every output must satisfy (JSON schema, regex, choice,
    grammar; see ``engine/grammar/structured_output.py``); None leaves the output free.
    structured_output_after: a token id (a reasoning model's ``</think>``): the output is free
    up to and including this token and the constraint holds for what follows (None: from the
    first token).
    max_tokens 0 generates nothing: with prompt_logprobs, a request that only scores its prompt.
    prompt_logprobs: report every prompt token's logprob with this many top alternatives (0:
    the token's own only; None: none). See ``engine/runner/prompt_logprobs.py``.
    min_tokens: EOS and ``stop_token_ids`` cannot be sampled before this many tokens (vLLM's).
    """

    max_tokens: int = 16
    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured_output: StructuredOutput | None = None
    structured_output_after: int | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if self.structured_output_after is not None and self.structured_output is None:
            raise ValueError("structured_output_after needs a structured_output")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias
        object.__setattr__(
            self,
            "logit_bias",
            tuple(tuple(p) for p in (bias.items() if isinstance(bias, dict) else bias)),
        )
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise ValueError(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise ValueError(
                "max_tokens must be an integer >= 1 (0 only scores a prompt, with prompt_logprobs)"
            )
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens!r}"
            )
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not math.isfinite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        if self.top_p < MIN_TOP_P:
            object.__setattr__(self, "top_p", MIN_TOP_P)
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(
                f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}"
            )
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not SEED_MIN <= self.seed <= SEED_MAX - (self.n - 1)
        ):
            raise ValueError(
                f"seed must be an integer in [{SEED_MIN}, {SEED_MAX - (self.n - 1)}] "
                f"(a 64-bit seed; with n samples, seed + n - 1 must fit too), got {self.seed!r}"
            )
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or abs(value) > MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value}")
        for token, value in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {token!r}")
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or abs(value) > MAX_LOGIT_BIAS
            ):
                raise ValueError(
                    f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                    f"got {value} for token {token}"
                )
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise ValueError("logit_bias has a token id twice")
        object.__setattr__(
            self, "logit_bias", tuple(sorted((t, float(b)) for t, b in self.logit_bias))
        )
        if not (
            MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY
        ):  # NaN fails this too
            raise ValueError(
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
                f"{MAX_REPETITION_PENALTY:g}] (1 is off), got {self.repetition_penalty}"
            )

    @property
    def has_penalties(self) -> bool:
        """True when any penalty changes the logits."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax at every step."""
        return self.temperature == 0.0
