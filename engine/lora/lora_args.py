"""The LoRA flags of ``vllm serve`` (its ``LoRAConfig`` help group): ``--enable-lora``,
``--lora-modules``, ``--max-loras``, ``--max-lora-rank`` and ``--max-cpu-loras``, turned into
the engine's ``LoRAConfig``.

``--lora-modules`` takes one or more adapters, each in either of vLLM's forms: ``name=path``,
or a JSON object ``{"name": ..., "path": ..., "base_model_name": ...}`` (``base_model_name``
optional). As in vLLM, every other LoRA flag needs ``--enable-lora``.
"""

from __future__ import annotations

import argparse
import json

from paged_serve.engine.lora.config import LoRAConfig, LoRAModule

_JSON_KEYS = frozenset({"name", "path", "base_model_name"})


def lora_module(text: str) -> LoRAModule:
    """One ``--lora-modules`` value, ``name=path`` or vLLM's JSON object; argparse reports the
    ArgumentTypeError's message."""
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"{text!r} must be a JSON object")
        unknown = sorted(set(value) - _JSON_KEYS)
        if unknown:
            raise argparse.ArgumentTypeError(
                f"{text!r}: unknown key(s) {unknown}; an adapter has name, path and base_model_name"
            )
        name, path = value.get("name"), value.get("path")
        base = value.get("base_model_name")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise argparse.ArgumentTypeError(f"{text!r} needs a non-empty string name and path")
        if base is not None and not isinstance(base, str):
            raise argparse.ArgumentTypeError(f"{text!r}: base_model_name must be a string")
        return LoRAModule(name, path, base)
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither name=path nor a JSON object with name and path"
        )
    return LoRAModule(name, path)


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's LoRA flags, in a ``LoRAConfig`` help group."""
    default = LoRAConfig()
    group = parser.add_argument_group("LoRAConfig")
    group.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters of the model: a request picks one by its name in 'model'",
    )
    group.add_argument(
        "--lora-modules",
        type=lora_module,
        nargs="+",
        action="extend",
        default=None,
        metavar="ADAPTER",
        help="adapters served from the start: name=path, or "
        '\'{"name": NAME, "path": PATH, "base_model_name": BASE}\' (several values, or the '
        "flag repeated)",
    )
    group.add_argument(
        "--max-loras",
        type=int,
        default=None,
        help=f"adapters one step may run, each in a device slot (default {default.max_loras})",
    )
    group.add_argument(
        "--max-lora-rank",
        type=int,
        default=None,
        help=f"the largest adapter rank served (default {default.max_lora_rank})",
    )
    group.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="adapters kept read in host memory (default: --max-loras)",
    )


def lora_config(args: argparse.Namespace) -> LoRAConfig | None:
    """The engine's ``LoRAConfig`` from ``add_lora_args``'s flags (None without
    ``--enable-lora``); ValueError naming the flag at fault."""
    given = {
        "--lora-modules": args.lora_modules,
        "--max-loras": args.max_loras,
        "--max-lora-rank": args.max_lora_rank,
        "--max-cpu-loras": args.max_cpu_loras,
    }
    if not args.enable_lora:
        used = [flag for flag, value in given.items() if value is not None]
        if used:
            raise ValueError(f"{', '.join(used)} needs --enable-lora (as in vLLM)")
        return None
    default = LoRAConfig()
    return LoRAConfig(
        max_loras=default.max_loras if args.max_loras is None else args.max_loras,
        max_lora_rank=default.max_lora_rank if args.max_lora_rank is None else args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        modules=tuple(args.lora_modules or ()),
    )
