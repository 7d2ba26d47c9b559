"""The ``vllm serve`` flags paged-serve does not implement, each refused with one line that names
it and says why (exit code 2, argparse's), never ignored.

A flag is refused only for the values that would change what vLLM does:
``--pipeline-parallel-size 1`` or ``--load-format safetensors`` describe what paged-serve does
anyway and are accepted, so a launch line that spells out vLLM's defaults
works. The table is docs/api.md's "vllm serve flags".
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Refusal:
    """``flag`` refused with ``reason`` unless its value is one of ``accepted`` (a flag that
    takes no value: always refused when ``takes_value`` is False)."""

    flags: tuple[str, ...]
    reason: str
    accepted: tuple[str, ...] = ()
    takes_value: bool = True


REFUSALS = (
    Refusal(("--trust-remote-code",), "models' own Python code is never run", takes_value=False),
    Refusal(
        ("--pipeline-parallel-size", "-pp"),
        "only tensor parallelism shards a model (--tensor-parallel-size)",
        accepted=("1",),
    ),
    Refusal(
        ("--data-parallel-size", "-dp"),
        "run one paged-serve per replica behind a router",
        accepted=("1",),
    ),
    Refusal(
        ("--fully-sharded-loras",),
        "adapters are sharded as their projections are (A whole beside column-parallel ones)",
        takes_value=False,
    ),
    Refusal(("--lora-dtype",), "adapters run in the model's dtype", accepted=("auto",)),
    Refusal(("--enable-lora-bias",), "adapters with LoRA biases are refused", takes_value=False),
    Refusal(
        ("--no-enable-chunked-prefill",),
        "prefills are always chunked to --max-num-batched-tokens",
        takes_value=False,
    ),
    Refusal(
        ("--enable-log-requests",),
        "requests are never logged (their prompts are users' data)",
        takes_value=False,
    ),
    Refusal(("--swap-space",), "a preempted request is recomputed, never swapped to the CPU"),
    Refusal(("--cpu-offload-gb",), "weights are never offloaded"),
    Refusal(("--tokenizer",), "the model's own tokenizer is used"),
    Refusal(("--revision", "--code-revision", "--tokenizer-revision"), "pass a folder instead"),
    Refusal(
        ("--load-format",), "weights load as safetensors or GGUF", accepted=("auto", "safetensors")
    ),
    Refusal(("--tokenizer-mode",), "the model's own tokenizer is used", accepted=("auto",)),
    Refusal(("--ssl-keyfile", "--ssl-certfile"), "serve plain HTTP behind a TLS-terminating proxy"),
    Refusal(("--root-path",), "serve at / behind a proxy that strips the prefix"),
    Refusal(("--middleware",), "no ASGI middleware: paged-serve is an aiohttp app"),
    Refusal(
        ("--override-generation-config",),
        "not implemented: use --generation-config FOLDER",
    ),
)


class _Refuse(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, *, refusal: Refusal, **kw: Any):
        super().__init__(option_strings, dest, nargs=None if refusal.takes_value else 0, **kw)
        self.refusal = refusal

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        r = self.refusal
        if r.takes_value and values in r.accepted:
            return
        shown = f"{option_string} {values}" if r.takes_value else option_string
        parser.error(f"{shown} is not supported by paged-serve: {r.reason}")


def add_refused_args(parser: argparse.ArgumentParser) -> None:
    """Every ``REFUSALS`` flag, in a help group of its own."""
    group = parser.add_argument_group(
        "vllm serve flags paged-serve refuses", "each exits with code 2 and its reason"
    )
    for refusal in REFUSALS:
        accepted = f" (accepted: {', '.join(refusal.accepted)})" if refusal.accepted else ""
        group.add_argument(
            *refusal.flags,
            action=_Refuse,
            refusal=refusal,
            dest=argparse.SUPPRESS,
            default=argparse.SUPPRESS,
            metavar="VALUE" if refusal.takes_value else None,
            help=refusal.reason + accepted,
        )
