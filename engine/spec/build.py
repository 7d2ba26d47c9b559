"""The engine's speculator from its configuration (None: every step decodes one token)."""

from __future__ import annotations

import logging

from paged_serve.engine.config import EngineConfig
from paged_serve.engine.model.loader import LoadedModel
from paged_serve.engine.platform.platform import Platform
from paged_serve.engine.spec.config import SpeculativeConfig
from paged_serve.engine.spec.ngram import NgramDrafter
from paged_serve.engine.spec.speculator import Speculator

logger = logging.getLogger(__name__)


def speculative_config_for(config: EngineConfig, platform: Platform) -> SpeculativeConfig | None:
    """The configuration in force: ``"auto"`` is prompt lookup with the defaults where the
    platform speculates by default (the CPU, where it was measured to pay:
    docs/measurements/speculation.md), and none elsewhere (CUDA, where it was not measured, and a
    drafted step also runs eagerly, outside the decode graphs)."""
    spec = config.speculative_config
    if spec == "auto":
        return SpeculativeConfig() if platform.speculates_by_default else None
    return spec


def build_speculator(
    config: EngineConfig,
    loaded: LoadedModel,
    platform: Platform,
    *,
    max_model_len: int,
    hybrid: object | None,
) -> Speculator | None:
    """The speculator for ``loaded`` (``hybrid``: its linear-attention state cache, if any)."""
    spec = speculative_config_for(config, platform)
    if spec is None:
        return None
    if hybrid is not None:
        # A recurrent state has taken in every drafted token; it cannot give back rejected ones.
        if config.speculative_config != "auto":
            raise ValueError(
                "speculative decoding cannot serve a hybrid linear-attention model: its "
                "recurrent state cannot roll back rejected drafts"
            )
        logger.info("speculative decoding is off: a hybrid model's state cannot roll back")
        return None
    if spec.method == "ngram":
        drafter = NgramDrafter(min_n=spec.prompt_lookup_min, max_n=spec.prompt_lookup_max)
    else:
        from paged_serve.engine.spec.draft_model import DraftModelDrafter

        drafter = DraftModelDrafter.load(spec, config, loaded, platform)
    logger.info(
        "speculative decoding: %s, up to %d tokens, while at most %d sequences run",
        spec.method,
        spec.num_speculative_tokens,
        spec.disable_by_batch_size,
    )
    return Speculator(spec, drafter, max_model_len=max_model_len)
