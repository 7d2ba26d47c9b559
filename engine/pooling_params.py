"""What a pooling request asks of the model: one vector (or one set of label scores) for its
whole prompt, instead of generated tokens.

The engine's pooling models (``engine/pooling/``) reduce the final hidden states of a prompt to
one row (the pooler: CLS, mean or last token), then turn that row into what ``task`` names:

    embed      the embedding (the sentence-transformers Dense layers, if any, then the first
               ``dimensions`` lanes, then L2-normalized unless ``normalize`` is False)
    classify   the classifier's label logits, turned into probabilities (softmax over the
               labels, or the sigmoid of a single label's logit) unless ``activation`` is False
"""

from __future__ import annotations

from dataclasses import dataclass

from paged_serve.engine.sampling_params import SamplingParams

POOLING_TASKS = ("embed", "classify")
# The sampling parameters a pooling request is queued with: one sample, nothing drawn.
POOLING_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """One pooling request's options.

    task: ``embed`` or ``classify`` (the model serves one; ``engine/pooling/pooling_model.py``).
    dimensions: embed only; keep the first ``dimensions`` lanes (a Matryoshka model's shorter
    embedding), before normalizing. None keeps them all.
    normalize: embed only; None follows the model (its sentence-transformers ``Normalize``
    module, or yes where it ships no such folder), True/False forces it.
    activation: classify only; False returns the raw logits.
    token_type_ids: the prompt's segment ids (a BERT cross-encoder's pair: 0 for the query, 1
    for the document), one per prompt token; None for all zeros.
    """

    task: str = "embed"
    dimensions: int | None = None
    normalize: bool | None = None
    activation: bool = True
    token_type_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"pooling task must be one of {POOLING_TASKS}, got {self.task!r}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be >= 1, got {self.dimensions}")
