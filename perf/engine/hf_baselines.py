"""The Hugging Face transformers systems paged-serve is measured against.

* ``hf_static``: one padded static batch through ``model.generate`` (left padding with an
  attention mask, greedy, ``max_new_tokens`` = the largest request's ``max_tokens``). The batch
  runs until its longest request is done; only each request's own ``max_tokens`` tokens are
  counted as output, the rest is padding work a static batch cannot avoid;
* ``hf_cb``: transformers' own continuous batching (``generate_batch``'s manager) with
  per-request ``max_new_tokens`` through ``ContinuousBatchingManager.add_request``, so it does
  exactly the useful work;
* ``hf_generate_batch``: the one-call ``model.generate_batch(...)``, which takes a single
  ``max_new_tokens`` for the whole batch: every request generates the largest ``max_tokens`` and
  only its own share is counted.

All are greedy with EOS ignored; each timed run follows a small untimed warm-up call.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

from perf.engine.e2e_workload import SystemResult, Workload, finish, timed

HF_SYSTEMS = ("hf_static", "hf_cb", "hf_generate_batch")


def hf_generate_padded(
    model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, pad_token_id: int
) -> list[list[int]]:
    """Greedy ``generate`` on a left-padded batch; returns every row's new tokens."""
    device = model.device
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        min_new_tokens=None,
        do_sample=False,
        eos_token_id=[],  # ignore EOS: every row generates max_new_tokens
        pad_token_id=pad_token_id,
    )
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids.to(device), attention_mask=mask.to(device), generation_config=config
        )
    return out[:, width:].tolist()


def run_hf_static(model: Any, workload: Workload, pad_token_id: int) -> SystemResult:
    """One padded batch of every request, run to the longest ``max_tokens``."""
    longest = max(workload.max_tokens)
    hf_generate_padded(model, workload.warmup_prompts, 4, pad_token_id)
    rows, wall = timed(
        model.device, lambda: hf_generate_padded(model, workload.prompts, longest, pad_token_id)
    )
    result = SystemResult(
        "hf_static",
        tokens=[row[:m] for row, m in zip(rows, workload.max_tokens)],
        generated_tokens=sum(len(r) for r in rows),
        notes=(
            f"padded static batch of {len(rows)} run to max_new_tokens={longest}; only each "
            "request's own max_tokens count as output."
        ),
    )
    return finish(result, workload, wall)


def hf_cb_page_size(config: ContinuousBatchingConfig) -> int:
    """Tokens per KV page of HF's CB cache: ``page_size`` in the transformers CI installs
    (5.24), ``block_size`` in 5.17 (the GPU machine's), which has no ``page_size``."""
    page_size = getattr(config, "page_size", None)
    return int(page_size if page_size is not None else config.block_size)


def hf_cb_config(
    kv_tokens: int | None, *, max_batch_tokens: int, max_requests: int
) -> ContinuousBatchingConfig:
    """HF's CB sized like paged-serve: the same KV capacity in tokens (None: transformers'
    own sizing) and the same per-step token and request budgets.

    On CPU transformers otherwise sizes the cache from total system RAM.
    """
    page_size = hf_cb_page_size(ContinuousBatchingConfig())
    return ContinuousBatchingConfig(
        num_blocks=None if kv_tokens is None else math.ceil(kv_tokens / page_size),
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_requests,
    )


def _greedy_no_eos(max_new_tokens: int, pad_token_id: int) -> GenerationConfig:
    # eos_token_id=-1 is continuous batching's "no EOS".
    return GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=pad_token_id
    )


def _check_outputs(outputs: Sequence[Any], n: int) -> str | None:
    missing = n - len(outputs)
    failed = [o.error for o in outputs if o.error is not None]
    if missing or failed:
        return f"{missing} requests missing, {len(failed)} failed: {failed[:1]}"
    return None


def hf_cb_per_request(
    model: Any,
    prompts: Sequence[Sequence[int]],
    max_tokens: Sequence[int],
    cb_config: ContinuousBatchingConfig,
    pad_token_id: int,
) -> list[Any]:
    """transformers' CB manager, each request with its own ``max_new_tokens``."""
    config = _greedy_no_eos(max(max_tokens), pad_token_id)
    done: dict[str, Any] = {}
    # No inference_mode() here: the manager's worker thread updates tensors this thread creates
    # in add_request, which transformers 5.17 then refuses as inference tensors.
    # timeout=None: leaving waits for the worker thread. With a join timeout (generate_batch's
    # is 5 s) the warm-up's thread outlived it on an H200, the manager restored the model's
    # attention under it, and the next run's thread crashed while the caller waited forever.
    with model.continuous_batching_context_manager(
        generation_config=config, continuous_batching_config=cb_config, block=True, timeout=None
    ) as manager:
        ids = [
            manager.add_request(
                input_ids=list(p), request_id=f"r{i}", max_new_tokens=m, eos_token_id=-1
            )
            for i, (p, m) in enumerate(zip(prompts, max_tokens))
        ]
        while len(done) < len(ids):
            out = manager.get_result(timeout=1)
            if out is None:
                if not manager.is_running():
                    break
                continue
            if out.is_finished():
                done[out.request_id] = out
    return [done[i] for i in ids if i in done]


def run_hf_cb(
    model: Any, workload: Workload, cb_config: ContinuousBatchingConfig, pad_token_id: int
) -> SystemResult:
    result = SystemResult(
        "hf_cb",
        notes="transformers continuous batching manager, per-request max_new_tokens.",
    )
    hf_cb_per_request(model, workload.warmup_prompts, [4, 4], cb_config, pad_token_id)
    outputs, wall = timed(
        model.device,
        lambda: hf_cb_per_request(
            model, workload.prompts, workload.max_tokens, cb_config, pad_token_id
        ),
    )
    result.error = _check_outputs(outputs, len(workload.prompts))
    result.tokens = [list(o.generated_tokens) for o in outputs]
    result.generated_tokens = sum(len(t) for t in result.tokens)
    return finish(result, workload, wall)


def run_hf_generate_batch(
    model: Any, workload: Workload, cb_config: ContinuousBatchingConfig, pad_token_id: int
) -> SystemResult:
    longest = max(workload.max_tokens)
    result = SystemResult(
        "hf_generate_batch",
        notes=(
            f"model.generate_batch takes one max_new_tokens: all requests ran to {longest}; only "
            "each request's own max_tokens count as output."
        ),
    )
    model.generate_batch(
        inputs=workload.warmup_prompts,
        generation_config=_greedy_no_eos(4, pad_token_id),
        continuous_batching_config=cb_config,
    )
    config = _greedy_no_eos(longest, pad_token_id)
    outputs, wall = timed(
        model.device,
        lambda: list(
            model.generate_batch(
                inputs=workload.prompts,
                generation_config=config,
                continuous_batching_config=cb_config,
            ).values()
        ),
    )
    result.error = _check_outputs(outputs, len(workload.prompts))
    rows = [list(o.generated_tokens) for o in outputs]
    result.generated_tokens = sum(len(r) for r in rows)
    result.tokens = [r[:m] for r, m in zip(rows, workload.max_tokens)]
    return finish(result, workload, wall)
