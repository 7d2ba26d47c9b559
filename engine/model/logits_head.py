"""The LM head as the model's own ``ForCausalLM.forward`` applies it: the output embedding, then
the family's transforms of the logits, op for op as Hugging Face computes them:

    Granite     logits / logits_scaling
    Cohere      logits * logit_scale
    Gemma 2, 3  tanh(logits / final_logit_softcapping) * final_logit_softcapping

The runner calls it on the rows it samples or scores only (HF's forward would take every row);
a captured decode graph runs HF's whole forward, transforms included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel


@dataclass(frozen=True, slots=True)
class LogitsHead:
    """``head(hidden [N, H])`` -> logits ``[N, V]``; a transform is None where the family has
    none (or it is the identity)."""

    linear: nn.Module
    divide_by: float | None = None
    multiply_by: float | None = None
    softcap: float | None = None

    @classmethod
    def of(cls, model: PreTrainedModel) -> LogitsHead:
        config = model.config.get_text_config()  # a vision-language model's decoder's

        def factor(name: str) -> float | None:
            value = getattr(config, name, None)
            return None if value is None or float(value) == 1.0 else float(value)

        softcap = getattr(config, "final_logit_softcapping", None)
        return cls(
            model.get_output_embeddings(),
            divide_by=factor("logits_scaling"),
            multiply_by=factor("logit_scale"),
            softcap=float(softcap) if softcap else None,
        )

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.linear(hidden)
        if self.divide_by is not None:
            logits = logits / self.divide_by
        if self.multiply_by is not None:
            logits = logits * self.multiply_by
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
