"""The model's ``generation_config.json`` sampling values as the defaults of requests that leave
a field out (vLLM's ``--generation-config``).

``--generation-config auto`` (the default) takes them from the served model's own generation
config, ``vllm`` takes none (OpenAI's defaults: temperature 1, top_p 1, no top-k, no min-p, no
repetition penalty), and a folder takes them from the ``generation_config.json`` in it. Only the
values that differ from ``GenerationConfig()``'s count, as in vLLM (transformers 5 leaves these
five unset by default, so every value the file sets counts). A field the request leaves out or
sends as ``null`` takes the default, as in vLLM. The file's ``max_new_tokens`` caps the output
of every request, as in vLLM: a request runs with the smallest of its own limit (``max_tokens``,
``max_completion_tokens``, ``max_output_tokens``; a completion that gives none has OpenAI's 16),
the rest of the context and ``max_new_tokens``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

import msgspec
from transformers import GenerationConfig

logger = logging.getLogger("server")

# generation_config.json key -> request field
CONFIG_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}
SOURCES = ("auto", "vllm")  # or a folder

BodyT = TypeVar("BodyT", bound=msgspec.Struct)


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """Request-field defaults; None: OpenAI's default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # max_new_tokens: the output cap where a request sets none

    @classmethod
    def from_generation_config(cls, config: GenerationConfig) -> SamplingDefaults:
        diff = config.to_diff_dict()
        values = {f: diff[k] for k, f in CONFIG_FIELDS.items() if diff.get(k) is not None}
        if isinstance(diff.get("max_new_tokens"), int) and diff["max_new_tokens"] > 0:
            values["max_tokens"] = diff["max_new_tokens"]
        return cls(**values)

    def values(self) -> dict[str, Any]:
        """The fields that are set."""
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}

    def fill(self, body: BodyT) -> BodyT:
        """``body`` with each sampling default set where its field is None (left out or null);
        ``max_tokens`` is not filled in but caps ``output_limit``."""
        sampling = {k: v for k, v in self.values().items() if k != "max_tokens"}
        changes = {k: v for k, v in sampling.items() if getattr(body, k, False) is None}
        return msgspec.structs.replace(body, **changes) if changes else body

    def fill_responses(self, body: BodyT) -> BodyT:
        """A Responses request with these defaults where it leaves temperature or top_p out,
        then OpenAI's 1.0 for what is still out (the Response object reports both); top-k,
        min-p and the repetition penalty are read from these defaults when its params are made
        (the Responses API has no such fields)."""
        body = self.fill(body)
        body.temperature = 1.0 if body.temperature is None else body.temperature
        body.top_p = 1.0 if body.top_p is None else body.top_p
        return body


def load_sampling_defaults(source: str, model_config: GenerationConfig | None) -> SamplingDefaults:
    """The defaults for ``--generation-config source``; ``model_config`` is the served model's
    generation config (None if it has none). A folder without a readable
    ``generation_config.json`` is a ValueError naming it."""
    if source == "vllm":
        return SamplingDefaults()
    if source == "auto":
        if model_config is None:
            return SamplingDefaults()
        return SamplingDefaults.from_generation_config(model_config)
    folder = Path(source)
    if not (folder / "generation_config.json").is_file():
        raise ValueError(
            f"--generation-config {source}: not 'auto', 'vllm' or a folder with a "
            "generation_config.json"
        )
    try:
        return SamplingDefaults.from_generation_config(GenerationConfig.from_pretrained(folder))
    except (OSError, ValueError) as exc:
        raise ValueError(f"--generation-config {source}: {exc}") from None


NO_DEFAULTS = SamplingDefaults()
