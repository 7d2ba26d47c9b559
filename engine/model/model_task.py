"""What a checkpoint is served for, decided once from its config and vLLM's two flags.

``--runner generate|pooling`` and ``--convert embed|classify`` (``auto`` by default) pick it;
``auto`` reads the checkpoint::

    architecture                         runner     convert     loaded as
    *ForCausalLM, *ForConditionalGen.    generate   -           AutoModelForCausalLM
      ... with sentence-transformers'    pooling    embed       AutoModelForCausalLM (the
          modules.json beside it                                 hidden states, no LM head run)
      ... with classifier_from_token     pooling    classify    AutoModelForCausalLM (the LM
          (--hf-overrides, vLLM's)                               head's rows of those tokens)
    *ForSequenceClassification           pooling    classify    AutoModelForSequenceClassif.
    a bare model (BertModel,             pooling    embed       AutoModel
      XLMRobertaModel, ModernBertModel)

A vision-language checkpoint of ``VISION_LANGUAGE_ARCHITECTURES`` (LLaVA) generates through
``AutoModelForImageTextToText``, its vision encoder beside the language model. A sentence-
transformers folder declares an embedding model, which is how Qwen3-Embedding and
gte-Qwen2 ship (``Qwen3ForCausalLM`` weights beside ``modules.json``). A choice the
checkpoint cannot serve (``--runner generate`` over a bare encoder, ``--convert classify``
without a classifier) is a ValueError naming why.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSequenceClassification,
    PretrainedConfig,
    PreTrainedModel,
)

from paged_serve.engine.config import CONVERTS, RUNNERS

GENERATIVE_SUFFIXES = ("ForCausalLM", "ForConditionalGeneration")
# vision-language checkpoints served with their vision encoder (engine/runner/image_embeddings.py)
VISION_LANGUAGE_ARCHITECTURES = ("LlavaForConditionalGeneration",)
SENTENCE_TRANSFORMERS_MODULES = "modules.json"


@dataclass(frozen=True, slots=True)
class ModelTask:
    """``runner``: ``generate`` or ``pooling``; ``convert``: ``embed`` or ``classify`` for a
    pooling model (None when generating)."""

    runner: str
    convert: str | None = None

    @property
    def pooling(self) -> bool:
        return self.runner == "pooling"

    def auto_class(self, config: PretrainedConfig) -> type:
        """The transformers auto class that loads the checkpoint for this task."""
        architecture = _architecture(config)
        if not self.pooling or not architecture or architecture.endswith(GENERATIVE_SUFFIXES):
            if architecture in VISION_LANGUAGE_ARCHITECTURES and not _maps(
                AutoModelForCausalLM, config
            ):
                return AutoModelForImageTextToText  # with its vision encoder: images in
            return AutoModelForCausalLM
        if architecture.endswith("ForSequenceClassification"):
            return AutoModelForSequenceClassification
        return AutoModel


GENERATE = ModelTask("generate")


def _maps(auto_class: type, config: PretrainedConfig) -> bool:
    """``auto_class`` builds a model for ``config``'s class."""
    return auto_class._model_mapping.get(type(config), None) is not None


def _architecture(config: PretrainedConfig) -> str:
    architectures = getattr(config, "architectures", None) or []
    return architectures[0] if architectures else ""


def resolve_task(
    config: PretrainedConfig, folder: str, runner: str = "auto", convert: str = "auto"
) -> ModelTask:
    """The task of the checkpoint at ``folder`` (a local folder or an id) with ``config``,
    under ``--runner`` and ``--convert`` (module docstring); ValueError when it cannot be."""
    if runner not in RUNNERS:
        raise ValueError(f"--runner must be one of {RUNNERS}, got {runner!r}")
    if convert not in CONVERTS:
        raise ValueError(f"--convert must be one of {CONVERTS}, got {convert!r}")
    architecture = _architecture(config)
    # a config that names no architecture loads as a causal LM, as it always has
    generative = not architecture or architecture.endswith(GENERATIVE_SUFFIXES)
    classifier = architecture.endswith("ForSequenceClassification")
    from_token = bool(getattr(config, "classifier_from_token", None))
    declared = (Path(folder) / SENTENCE_TRANSFORMERS_MODULES).is_file()
    if runner == "auto":
        pooling = not generative or from_token or declared or convert != "auto"
        runner = "pooling" if pooling else "generate"
    if runner == "generate":
        if not generative:
            raise ValueError(
                f"{architecture or 'this model'} does not generate text: serve it with "
                "--runner pooling (embeddings, scores)"
            )
        if convert != "auto":
            raise ValueError("--convert applies to --runner pooling only")
        return ModelTask("generate")
    if convert == "auto":
        convert = "classify" if classifier or from_token else "embed"
    if convert == "classify" and not (classifier or from_token):
        raise ValueError(
            f"{architecture or 'this model'} has no classifier: --convert classify needs a "
            "*ForSequenceClassification checkpoint, or a causal LM with "
            '--hf-overrides \'{"classifier_from_token": ["no", "yes"]}\''
        )
    return ModelTask("pooling", convert)


def position_offset(model: PreTrainedModel) -> int:
    """What RoBERTa-style embeddings add to each position (they number positions from
    ``padding_idx + 1``, computed from the ids where none are given); 0 for other models."""
    embeddings = getattr(model.base_model, "embeddings", None)
    if embeddings is not None and hasattr(embeddings, "create_position_ids_from_input_ids"):
        return int(embeddings.padding_idx) + 1
    return 0
