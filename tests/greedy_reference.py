"""Greedy comparisons that state their tolerance: through a float64 Hugging Face reference.

Two fp32 runs of one model -- eager and CUDA-graph steps (different GEMM shapes, different
split-KV factors), our kernels and HF's attention -- differ in their last bits, each in its own
way, so "the same greedy tokens" is only sound where no step is a near-tie. The comparison
therefore goes through the model in float64:

1. the reference: float64 greedy tokens and the float64 log-softmax at every step along them;
2. its top-1 minus top-2 margin must exceed ``2 * LOGPROB_TOL`` at every step (a property of
   the test data, checked, never assumed);
3. at every step a run's reported logprob of its token must be within ``LOGPROB_TOL`` of the
   float64 value, and its token within ``2 * LOGPROB_TOL`` of the float64 best.

Given 2, a run that passes 3 picks the float64 token at every step, so token-for-token equality
between runs follows from the checked tolerance instead of being hoped for. ``LOGPROB_TOL`` is
2e-4: fp32 forwards of the tiny test models are within ~1e-5 of float64 on a CPU.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from paged_serve.engine.outputs import CompletionResult
from tests.conftest import hf_greedy

LOGPROB_TOL = 2e-4


@dataclass(frozen=True)
class GreedyReference:
    """A prompt's float64 greedy continuation and the log-softmax at each of its steps."""

    tokens: list[int]
    logprobs: torch.Tensor  # [steps, V] float64, teacher-forced along ``tokens``

    @property
    def margins(self) -> torch.Tensor:
        """``[steps]``: best minus second-best logprob."""
        top2 = self.logprobs.topk(2, dim=-1).values
        return top2[:, 0] - top2[:, 1]


def float64_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A float64 CPU copy of ``model`` (the original is left as it is)."""
    return copy.deepcopy(model).to(device="cpu", dtype=torch.float64)


@torch.inference_mode()
def greedy_reference(model64: PreTrainedModel, prompt: list[int], steps: int) -> GreedyReference:
    """float64 greedy tokens for ``prompt`` and the log-softmax at every step, in one forward."""
    tokens = hf_greedy(model64, prompt, steps)
    logits = model64(input_ids=torch.tensor([prompt + tokens])).logits[0]
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + steps - 1], dim=-1)
    return GreedyReference(tokens, logprobs)


def assert_greedy_within_tolerance(
    result: CompletionResult, ref: GreedyReference, tol: float = LOGPROB_TOL
) -> None:
    """``result`` (generated with ``logprobs`` set) follows ``ref`` within ``tol`` at every step."""
    assert result.logprobs is not None and len(result.token_ids) == len(ref.tokens)
    near_ties = (ref.margins <= 2 * tol).nonzero().flatten().tolist()
    assert not near_ties, f"test data has float64 near-ties at steps {near_ties}: pick others"
    for step, (token, entry) in enumerate(zip(result.token_ids, result.logprobs)):
        exact = ref.logprobs[step]
        error = abs(entry.logprob - float(exact[token]))
        assert error <= tol, f"step {step}: logprob {entry.logprob} vs float64 {exact[token]}"
        assert float(exact.max() - exact[token]) <= 2 * tol, f"step {step}: not float64's best"
    assert result.token_ids == ref.tokens
