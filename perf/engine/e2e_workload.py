"""The end-to-end benchmark's workload and what a system's run produced.

A ``Workload`` is the synthetic requests every system runs (token-id prompts and each
request's ``max_tokens``); a ``SystemResult`` is one system's run of it. ``finish`` fills in the
throughput the report compares: useful output tokens (each request's own ``max_tokens``, not
padding work) per second of wall time. ``agreement`` compares two systems' greedy tokens.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class Workload:
    """Prompts (token ids) and each request's output length."""

    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)

    @property
    def warmup_prompts(self) -> list[list[int]]:
        """Two short prompts for each system's untimed warm-up call."""
        return [self.prompts[0][:8], self.prompts[-1][:8]]

    def summary(self, seed: int) -> dict[str, Any]:
        return {
            "num_requests": len(self.prompts),
            "prompt_tokens": self.num_prompt_tokens,
            "output_tokens": self.num_output_tokens,
            "prompt_lengths": [len(p) for p in self.prompts],
            "max_tokens": self.max_tokens,
            "seed": seed,
            "greedy": True,
            "ignore_eos": True,
        }


@dataclass(slots=True)
class SystemResult:
    """One system's run. Times in seconds; ``tokens`` holds each request's useful outputs."""

    name: str
    wall_s: float | None = None
    useful_output_tokens: int = 0
    generated_tokens: int = 0
    output_tokens_per_s: float | None = None
    error: str | None = None
    notes: str = ""
    wall_s_runs: list[float | None] = field(default_factory=list)
    load_average: list[dict[str, list[float] | None]] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        del out["tokens"]
        return out


def make_workload(
    tokenizer: Any,
    vocab_size: int,
    *,
    num_requests: int,
    min_prompt: int,
    max_prompt: int,
    min_tokens: int,
    max_tokens: int,
    seed: int,
) -> Workload:
    """Random prompts (uniform lengths, ordinary-vocabulary ids) and uniform output lengths."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    ordinary = [t for t in range(vocab_size) if t not in special]
    rng = random.Random(seed)
    prompts = [
        [rng.choice(ordinary) for _ in range(rng.randint(min_prompt, max_prompt))]
        for _ in range(num_requests)
    ]
    outputs = [rng.randint(min_tokens, max_tokens) for _ in range(num_requests)]
    return Workload(prompts, outputs)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()`` and its wall seconds, the device's queued work included."""
    _sync(device)
    start = time.perf_counter()
    value = fn()
    _sync(device)
    return value, time.perf_counter() - start


def finish(result: SystemResult, workload: Workload, wall: float) -> SystemResult:
    """Fill in ``result``'s wall time and throughput from its ``tokens``; a shortfall against
    the requested output is noted."""
    result.wall_s = round(wall, 3)
    result.useful_output_tokens = sum(len(t) for t in result.tokens)
    result.output_tokens_per_s = round(result.useful_output_tokens / wall, 2)
    if result.useful_output_tokens != workload.num_output_tokens:
        result.notes += (
            f" produced {result.useful_output_tokens} of {workload.num_output_tokens}"
            " requested tokens."
        )
    return result


def agreement(reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]]) -> dict:
    """Token-for-token agreement of greedy outputs, request by request.

    A greedy sequence that differs once continues differently, so the matched length is the
    length of the common prefix; ``first_divergence`` maps request index to that position.
    """
    matched = total = exact = 0
    divergence: dict[int, int] = {}
    for i, (ref, out) in enumerate(zip(reference, other)):
        prefix = 0
        while prefix < min(len(ref), len(out)) and ref[prefix] == out[prefix]:
            prefix += 1
        matched += prefix
        total += len(ref)
        if prefix == len(ref) == len(out):
            exact += 1
        else:
            divergence[i] = prefix
    return {
        "requests": min(len(reference), len(other)),
        "exact_requests": exact,
        "token_match_rate": round(matched / total, 4) if total else None,
        "first_divergence": divergence,
    }
