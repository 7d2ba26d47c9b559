"""The request mixes ``perf.serving.bench_serving`` sends through an OpenAI-compatible server.

Every prompt is a list of token ids, made with the model's tokenizer and sent as such, so each
server sees exactly the same tokens (paged-serve and llama.cpp's ``llama-server`` both accept
token ids as a ``/v1/completions`` prompt). Every request is greedy with ``ignore_eos``, so it
runs to its ``max_tokens``. Fixed seeds make every mix the same on every run.

* ``decode-heavy``: 24 requests, prompts of 10-120 random ordinary tokens, ``max_tokens``
  uniform in 8-96, all sent at once (``perf.engine.e2e_workload.make_workload``, seed 0);
* ``long-prompt``: the same generator with ``perf.engine.bench_e2e``'s defaults (prompts 10-400);
* ``shared-prefix``: a chat mix, one long system prompt (about 330 tokens) before 24 different
  user turns of 8-40 words, through the model's chat template; ``max_tokens`` 16-64;
* ``concurrency-1``, ``concurrency-8``: closed loop, that many streams each sending its next
  request when the last one ends; prompts of 64-76 random tokens, 32 output tokens each;
* ``copy-heavy-1``, ``copy-heavy-4``: closed loop of 1 or 4 streams, prompts that hold most of
  their answer (rewrite one of this repository's functions with a parameter renamed, quote a
  paragraph of docs/), 160 output tokens each: where speculative decoding pays;
* ``decode-heavy-1``, ``decode-heavy-4``: the decode-heavy mix's first requests as a closed
  loop of 1 or 4 streams.

``arrival_offsets`` turns a request rate into Poisson arrival times for the open-loop mixes.
"""

from __future__ import annotations

import ast
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from perf.engine.e2e_workload import make_workload

# A fixed system prompt long enough that its KV blocks dominate each request's prefill.
SYSTEM_PROMPT = (
    "You are the support assistant of a small public library. Answer questions about opening "
    "hours, membership, borrowing rules, events and the reading rooms. Be brief and precise, "
    "and say so when you do not know. Opening hours: Monday to Friday from nine in the morning "
    "to eight in the evening, Saturday from ten to five, closed on Sunday and public holidays. "
    "Membership is free for residents of the city and costs twenty euros a year for everyone "
    "else; children under twelve need a parent's signature. Members may borrow up to ten books, "
    "five magazines and three films at a time. Books are lent for three weeks, magazines and "
    "films for one week; a loan can be renewed twice online or at the desk unless another "
    "member has reserved the item. Late returns cost twenty cents per item and day, capped at "
    "five euros per item. Lost items are replaced at the list price. The quiet reading room on "
    "the second floor is for silent study only; the group room on the first floor can be booked "
    "for two hours at a time. Free wireless internet is available in the whole building, and "
    "the four public computers can be booked for one hour a day. Events: a children's story "
    "hour every Wednesday at four, a book club on the first Thursday of the month at seven, and "
    "a local history talk every second Saturday at eleven. Printing costs ten cents per page in "
    "black and white and fifty cents in colour."
)
USER_WORDS = (
    "when can I borrow books films magazine renew loan late fee children card membership price "
    "room booking print colour page event story hour club history talk open Saturday Sunday "
    "holiday wireless computer lost replace reserve desk online quiet study group evening"
).split()
CONCURRENCY_PROMPT_TOKENS = (64, 76)  # about 70
CONCURRENCY_OUTPUT_TOKENS = 32


@dataclass(frozen=True, slots=True)
class ServingWorkload:
    """Token-id prompts and each request's ``max_tokens``.

    ``streams`` set: a closed loop of that many concurrent streams; ``None``: open loop, every
    request sent at its arrival time (all at once unless a request rate is given).
    """

    name: str
    prompts: list[list[int]]
    max_tokens: list[int]
    streams: int | None = None

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.max_tokens):
            raise ValueError(f"{len(self.prompts)} prompts but {len(self.max_tokens)} max_tokens")

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    def summary(self) -> dict[str, Any]:
        lengths = [len(p) for p in self.prompts]
        return {
            "name": self.name,
            "num_requests": self.num_requests,
            "streams": self.streams,
            "prompt_tokens": sum(lengths),
            "prompt_tokens_min_max": [min(lengths), max(lengths)],
            "output_tokens": sum(self.max_tokens),
            "max_tokens_min_max": [min(self.max_tokens), max(self.max_tokens)],
        }


def decode_heavy(tokenizer: Any, num_requests: int = 24, seed: int = 0) -> ServingWorkload:
    w = make_workload(
        tokenizer,
        tokenizer.vocab_size,
        num_requests=num_requests,
        min_prompt=10,
        max_prompt=120,
        min_tokens=8,
        max_tokens=96,
        seed=seed,
    )
    return ServingWorkload("decode-heavy", w.prompts, w.max_tokens)


def long_prompt(tokenizer: Any, num_requests: int = 24, seed: int = 0) -> ServingWorkload:
    """``perf.engine.bench_e2e``'s default mix (figures in docs/measurements/engine-vs-hf.md)."""
    w = make_workload(
        tokenizer,
        tokenizer.vocab_size,
        num_requests=num_requests,
        min_prompt=10,
        max_prompt=400,
        min_tokens=8,
        max_tokens=96,
        seed=seed,
    )
    return ServingWorkload("long-prompt", w.prompts, w.max_tokens)


def shared_prefix(tokenizer: Any, num_requests: int = 24, seed: int = 0) -> ServingWorkload:
    """One system prompt, different user turns, through the tokenizer's chat template."""
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(num_requests):
        words = [rng.choice(USER_WORDS) for _ in range(rng.randint(8, 40))]
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": " ".join(words).capitalize() + "?"},
        ]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(list(tokenizer(text, add_special_tokens=False).input_ids))
        outputs.append(rng.randint(16, 64))
    return ServingWorkload("shared-prefix", prompts, outputs)


def fixed_concurrency(
    tokenizer: Any, streams: int, num_requests: int | None = None, seed: int = 0
) -> ServingWorkload:
    """A closed loop of ``streams`` streams; by default 4 requests per stream (at least 8)."""
    n = num_requests if num_requests is not None else max(8, 4 * streams)
    low, high = CONCURRENCY_PROMPT_TOKENS
    w = make_workload(
        tokenizer,
        tokenizer.vocab_size,
        num_requests=n,
        min_prompt=low,
        max_prompt=high,
        min_tokens=CONCURRENCY_OUTPUT_TOKENS,
        max_tokens=CONCURRENCY_OUTPUT_TOKENS,
        seed=seed + streams,  # different prompts per stream count: no prefix-cache carry-over
    )
    return ServingWorkload(f"concurrency-{streams}", w.prompts, w.max_tokens, streams=streams)


COPY_OUTPUT_TOKENS = 160
_COPY_FOLDERS = ("engine", "server")


def _functions(root: Path) -> list[tuple[str, str]]:
    """(source, one parameter name) of every top-level function of 12-40 lines with a
    parameter, in the shipped Python sources under ``root``, in file order."""
    found = []
    for folder in _COPY_FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            source = path.read_text()
            for node in ast.parse(source).body:
                if not isinstance(node, ast.FunctionDef) or not 12 <= len(node.body) <= 40:
                    continue
                names = [a.arg for a in node.args.args if len(a.arg) > 3]
                code = ast.get_source_segment(source, node)
                if names and code and code.count("\n") < 40:
                    found.append((code, names[0]))
    return found


def _paragraphs(root: Path) -> list[str]:
    """The prose paragraphs of docs/ of 300-900 characters, in file order."""
    found = []
    for path in sorted((root / "docs").glob("*.md")):
        for block in path.read_text().split("\n\n"):
            text = " ".join(block.split())
            if 300 <= len(text) <= 900 and text[0].isalpha():
                found.append(text)
    return found


def copy_heavy(
    tokenizer: Any, streams: int, num_requests: int | None = None, seed: int = 0
) -> ServingWorkload:
    """Prompts that hold most of their answer, built from the project's own text through the
    chat template: "rewrite this function with one parameter renamed" (a function of this
    repository) and "quote this paragraph, then give it a title" (a paragraph of docs/),
    alternately; a closed loop of ``streams`` streams, 4 requests each (at least 4)."""
    root = Path(__file__).resolve().parents[2]  # perf/serving/workloads.py -> the checkout
    rng = random.Random(seed)
    functions, paragraphs = _functions(root), _paragraphs(root)
    n = num_requests if num_requests is not None else max(4, 4 * streams)
    prompts = []
    for i in range(n):
        if i % 2 == 0:
            code, name = rng.choice(functions)
            task = (
                f"Rewrite this Python function with the parameter `{name}` renamed to "
                f"`{name}_value`. Reply with the code only.\n\n```python\n{code}\n```"
            )
        else:
            task = (
                "Quote the following paragraph word for word, then give it a short title."
                f"\n\n{rng.choice(paragraphs)}"
            )
        messages = [{"role": "user", "content": task}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(list(tokenizer(text, add_special_tokens=False).input_ids))
    return ServingWorkload(
        f"copy-heavy-{streams}", prompts, [COPY_OUTPUT_TOKENS] * n, streams=streams
    )


def decode_heavy_streams(
    tokenizer: Any, streams: int, num_requests: int | None = None, seed: int = 0
) -> ServingWorkload:
    """The decode-heavy mix's first requests (4 per stream unless given) as a closed loop of
    ``streams`` streams."""
    w = decode_heavy(tokenizer, num_requests or max(4, 4 * streams), seed)
    return ServingWorkload(f"decode-heavy-{streams}", w.prompts, w.max_tokens, streams=streams)


# name -> builder(tokenizer, num_requests or None, seed)
WORKLOADS: dict[str, Callable[[Any, int | None, int], ServingWorkload]] = {
    "decode-heavy": lambda t, n, s: decode_heavy(t, n or 24, s),
    "long-prompt": lambda t, n, s: long_prompt(t, n or 24, s),
    "shared-prefix": lambda t, n, s: shared_prefix(t, n or 24, s),
    "concurrency-1": lambda t, n, s: fixed_concurrency(t, 1, n, s),
    "concurrency-8": lambda t, n, s: fixed_concurrency(t, 8, n, s),
    "copy-heavy-1": lambda t, n, s: copy_heavy(t, 1, n, s),
    "copy-heavy-4": lambda t, n, s: copy_heavy(t, 4, n, s),
    "decode-heavy-1": lambda t, n, s: decode_heavy_streams(t, 1, n, s),
    "decode-heavy-4": lambda t, n, s: decode_heavy_streams(t, 4, n, s),
}


def arrival_offsets(num_requests: int, rate: float, seed: int = 0) -> list[float]:
    """Seconds from the start at which each request is sent: a Poisson process of ``rate``
    requests per second (exponential gaps, the first request at 0); ``inf``: all at 0."""
    if rate <= 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for i in range(num_requests):
        if i:
            t += rng.expovariate(rate)
        offsets.append(t)
    return offsets
