"""Speculative decoding's configuration: vLLM's ``--speculative-config`` JSON, checked once.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"method": "draft_model", "model": "path/to/small-model", "num_speculative_tokens": 4}

``disable_by_batch_size`` is vLLM's key too: while more sequences than that run, no step
speculates (verifying drafts then costs more than the tokens it saves). Keys vLLM has and
paged-serve does not act on are refused by name, never ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "draft_model")
# vLLM's aliases of the same two methods
_METHOD_ALIASES = {"ngram": "ngram", "draft_model": "draft_model", "draft": "draft_model"}


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """How the engine drafts and how far.

    method: ``ngram`` (prompt lookup, no model) or ``draft_model`` (``model``, a causal LM with
    the target's vocabulary, on its own paged KV cache).
    num_speculative_tokens: the most tokens drafted per sequence and step (k); a sequence's
    own k adapts below it to the acceptance it gets (``engine/spec/speculator.py``).
    prompt_lookup_max / prompt_lookup_min: the longest and shortest suffix (tokens) the n-gram
    drafter matches against the sequence's earlier tokens, longest first.
    disable_by_batch_size: speculate only while at most this many sequences run.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 8
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None
    disable_by_batch_size: int = 4

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"num_speculative_tokens must be 1..16, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError('the draft_model method needs "model": a folder or a .gguf file')
        if self.method == "ngram" and self.model:
            raise ValueError('the ngram method takes no "model" (did you mean draft_model?)')
        if self.disable_by_batch_size < 1:
            raise ValueError(
                f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}"
            )

    @classmethod
    def from_dict(cls, spec: dict) -> SpeculativeConfig:
        """The config of vLLM's JSON object; ValueError naming any key paged-serve lacks."""
        if not isinstance(spec, dict):
            raise ValueError("the speculative config must be a JSON object")
        spec = dict(spec)
        # vLLM infers the method from "model" when none is given; "[ngram]" is its old spelling.
        method = spec.pop("method", None)
        if method is None:
            method = "ngram" if spec.get("model") in (None, "[ngram]") else "draft_model"
        if spec.get("model") == "[ngram]":
            spec.pop("model")
        if method not in _METHOD_ALIASES:
            raise ValueError(
                f"speculative method {method!r} is not supported (supported: {METHODS})"
            )
        if spec.get("draft_tensor_parallel_size", 1) != 1:
            raise ValueError("the draft model runs on rank 0 alone: draft_tensor_parallel_size 1")
        spec.pop("draft_tensor_parallel_size", None)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"speculative config keys not supported: {', '.join(unknown)}")
        return cls(method=_METHOD_ALIASES[method], **spec)

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig | None:
        """``--speculative-config``'s value: a JSON object, or ``off``/``null`` for none."""
        if text.strip().lower() in ("off", "none", "null", "false"):
            return None
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the speculative config is not JSON: {exc}") from None
        return None if spec is None else cls.from_dict(spec)
