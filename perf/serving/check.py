"""The correctness check ``perf.serving.bench_serving`` runs on a server before timing it.

Every request of the mix is sent greedy and non-streamed (``perf.serving.client.complete_all``):

1. each reply must report exactly its ``max_tokens`` output tokens in ``usage`` (EOS is
   ignored), and no request may fail;
2. on a sample of requests the reply's text is compared with Hugging Face ``generate`` on the
   same prompt alone (greedy, EOS ignored) in the precision the system should match. Token ids
   are compared through the tokenizer: a reply matches the reference's first ``k`` tokens when
   ``decode(reference[:k])`` is a prefix of its text (re-tokenizing the text instead could
   merge tokens differently). ``exact`` requests match all their reference tokens and nothing
   more; ``token_match_rate`` is matched over reference tokens.

With ``require_hf_equality`` (paged-serve in float32, whose greedy tokens must equal HF fp32)
any difference fails the check; otherwise the agreement rate is reported and only 1 can fail.

``ignore_eos`` differs between servers: paged-serve (like vLLM and HF with no EOS) may still
generate an end-of-generation token and goes on; llama.cpp's ``llama-server`` bans them (a -inf
logit bias on every EOG token). The reference for llama.cpp therefore suppresses the same
tokens (``llama_cpp_eog_ids``), so the agreement rate measures arithmetic, not that rule. Texts
are compared with special tokens skipped, as both servers render them by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig

from perf.serving.client import Reply
from perf.serving.workloads import ServingWorkload


def sample_indices(num_requests: int, k: int) -> list[int]:
    """``k`` request indices spread evenly over the mix (the first and the last included)."""
    if k <= 0 or num_requests == 0:
        return []
    if k >= num_requests:
        return list(range(num_requests))
    if k == 1:
        return [0]
    return sorted({round(i * (num_requests - 1) / (k - 1)) for i in range(k)})


# The token texts llama.cpp treats as end of generation (src/llama-vocab.cpp), the ones a
# small model's vocabulary may have; with the model's EOS ids they are what ignore_eos bans.
LLAMA_CPP_EOG_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<|end_of_text|>", "<EOT>", "<eos>", "</s>",
)


def llama_cpp_eog_ids(tokenizer: Any, eos_ids: Sequence[int]) -> list[int]:
    """The ids ``llama-server`` bans under ``ignore_eos``: the EOS ids and the EOG texts."""
    vocab = tokenizer.get_vocab()
    return sorted(set(eos_ids) | {vocab[t] for t in LLAMA_CPP_EOG_TEXTS if t in vocab})


@torch.inference_mode()
def hf_greedy(
    model: Any, prompt: Sequence[int], max_new_tokens: int, suppress: Sequence[int] = ()
) -> list[int]:
    """HF ``generate`` on one prompt alone: greedy, EOS ignored, ``suppress`` ids never chosen."""
    ids = torch.tensor([list(prompt)], device=model.device)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        min_new_tokens=None,
        do_sample=False,
        eos_token_id=[],  # ignore EOS: generate max_new_tokens
        pad_token_id=0,
        suppress_tokens=list(suppress) or None,
    )
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt) :].tolist()


def hf_references(
    model: Any, workload: ServingWorkload, indices: Sequence[int], suppress: Sequence[int] = ()
) -> dict[int, list[int]]:
    """HF greedy tokens for each request in ``indices`` (``hf_greedy``)."""
    return {
        i: hf_greedy(model, workload.prompts[i], workload.max_tokens[i], suppress)
        for i in indices
    }


def matched_tokens(tokenizer: Any, reference: Sequence[int], text: str) -> int:
    """The largest ``k`` with ``decode(reference[:k])`` a prefix of ``text``."""
    best = 0
    for k in range(1, len(reference) + 1):
        if text.startswith(tokenizer.decode(reference[:k], skip_special_tokens=True)):
            best = k
    return best


@dataclass(slots=True)
class CheckResult:
    """What the check found; ``passed`` says whether timing may go ahead."""

    workload: str
    requests: int
    failed_requests: int = 0
    wrong_length: dict[int, int | None] = field(default_factory=dict)  # index -> reported tokens
    hf_dtype: str = ""
    hf_checked: int = 0
    hf_exact: int = 0
    token_match_rate: float | None = None
    first_divergence: dict[int, int] = field(default_factory=dict)  # index -> matched tokens
    require_hf_equality: bool = False
    errors: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        if self.failed_requests or self.wrong_length:
            return False
        return not self.require_hf_equality or self.hf_exact == self.hf_checked

    def summary(self) -> str:
        """A short cell for the report table, e.g. ``ok, HF 4/4 exact, 100.0% tokens``."""
        head = "ok" if self.passed else "FAILED"
        if self.failed_requests or self.wrong_length:
            head += f" ({self.failed_requests} failed, {len(self.wrong_length)} wrong length)"
        if not self.hf_checked:
            return head
        rate = "-" if self.token_match_rate is None else f"{100 * self.token_match_rate:.1f}%"
        return f"{head}, HF {self.hf_dtype} {self.hf_exact}/{self.hf_checked} exact, {rate} tokens"

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["passed"] = self.passed
        return out


def check_replies(
    workload: ServingWorkload,
    replies: Sequence[Reply],
    *,
    tokenizer: Any,
    references: dict[int, list[int]],
    hf_dtype: str,
    require_hf_equality: bool,
) -> CheckResult:
    """Check every reply's length and the sampled replies against their HF references."""
    result = CheckResult(
        workload.name,
        len(replies),
        hf_dtype=hf_dtype,
        require_hf_equality=require_hf_equality,
    )
    for i, (reply, wanted) in enumerate(zip(replies, workload.max_tokens)):
        if reply.error is not None:
            result.failed_requests += 1
            result.errors.append(f"request {i}: {reply.error}")
        elif reply.completion_tokens != wanted:
            result.wrong_length[i] = reply.completion_tokens
    matched = total = 0
    for i, reference in sorted(references.items()):
        reply = replies[i]
        if reply.error is not None:
            continue
        k = matched_tokens(tokenizer, reference, reply.text)
        result.hf_checked += 1
        matched += k
        total += len(reference)
        if k == len(reference) and reply.text == tokenizer.decode(
            reference, skip_special_tokens=True
        ):
            result.hf_exact += 1
        else:
            result.first_divergence[i] = k
    result.token_match_rate = round(matched / total, 4) if total else None
    return result
