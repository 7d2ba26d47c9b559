"""A request's state as it moves through the scheduler: tokens, progress and timestamps."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from paged_serve.engine.lora.adapter_files import LoRAAdapter
from paged_serve.engine.multimodal_inputs import ImageInput
from paged_serve.engine.outputs import TokenLogprob
from paged_serve.engine.pooling_params import PoolingParams
from paged_serve.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Request:
    """One sequence being generated.

    ``index`` is the sample's position among the ``n`` samples of one request.
    ``num_computed_tokens`` counts the tokens whose K/V are in the cache; the tokens still to
    run through the model are ``all_token_ids[num_computed_tokens:]``. After a preemption it
    drops to 0 and the prompt plus the outputs so far are recomputed.
    Times are ``time.monotonic()`` seconds. ``cache_salt`` names the prefix-cache chain its
    blocks are looked up and committed in (``BlockManager.cached_prefix``; None: the shared
    unsalted chain); the samples of one request share it.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    index: int = 0
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None  # time.monotonic() seconds of the latest output token
    first_scheduled_time: float | None = None  # first admission into the running batch
    # n > 1: samples waiting for this request's prompt to be computed, then forked from it
    # (the lifecycle lives in engine/sched/forks.py).
    pending_forks: list[Request] = field(default_factory=list)
    fork_parent: Request | None = None
    # With a structured output: the sequence's grammar matcher (xgrammar.GrammarMatcher), fed
    # every accepted token; it survives preemption (the outputs are kept, only K/V recomputed).
    matcher: object | None = None
    # With structured_output_after: the matcher, held here until that token is sampled.
    deferred_matcher: object | None = None
    # Its slowest grammar-mask fill of the last step, as a share of --grammar-fill-timeout
    # (engine/sample/token_mask.py): the speculator drafts less for a slow matcher.
    mask_fill_share: float = 0.0
    # With prompt_logprobs asked: one entry per prompt token scored so far (None for token 0,
    # which has no context); see engine/runner/prompt_logprobs.py.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # A pooling request (engine/pooling/): its prompt is pooled into one row, nothing is
    # generated. ``pool_state`` is the pooler's running state between prompt chunks (a device
    # tensor, engine/pooling/pooler.py); ``whole_prompt`` asks every prompt token to be computed
    # (a pooling that reads each one: no prefix-cache hit may skip any).
    pooling: PoolingParams | None = None
    pool_state: object | None = None
    whole_prompt: bool = False
    # A prompt with images (engine/multimodal_inputs.py): each image's placeholder span and
    # tensors, and the prompt's prefix-cache keys (placeholders keyed by their image).
    images: tuple[ImageInput, ...] = ()
    prompt_key_ids: list[int] | None = None
    # A request for a LoRA adapter (engine/lora/): the adapter, and the slot it runs in while
    # admitted (-1 otherwise; engine/lora/adapter_slots.py).
    lora: LoRAAdapter | None = None
    lora_slot: int = -1

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def needs_prompt_scoring(self) -> bool:
        """Asked for prompt logprobs and some prompt token is not scored yet (such a request
        computes its whole prompt: a cached block has no logits)."""
        scored = self.prompt_logprobs
        return scored is not None and len(scored) < len(self.prompt_token_ids)

    @property
    def skips_prefix_cache(self) -> bool:
        """Every prompt token must be computed: prompt logprobs still to score, or a pooling
        that reads each token's hidden state."""
        return self.whole_prompt or self.needs_prompt_scoring

    @property
    def prefix_chain(self) -> str | None:
        """The prefix-cache chain this request's blocks are looked up and committed in: its
        cache salt's, or with an adapter one of the adapter's own (a base-model block never
        serves an adapter's request, nor one adapter's another's). Adapter chains start with a
        NUL character, which a cache salt may not hold (``check_cache_salt``)."""
        if self.lora is None:
            return self.cache_salt
        return f"\0lora{self.lora.id}\0{self.cache_salt or ''}"

    @property
    def cache_token_ids(self) -> list[int]:
        """The tokens the prefix cache keys this request's blocks by: ``all_token_ids``, an
        image's placeholders replaced by its key (``cache_key_ids``)."""
        if self.prompt_key_ids is None:
            return self.all_token_ids
        return self.prompt_key_ids + self.output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens_between(self, start: int, end: int) -> list[int]:
        """Tokens at positions ``[start, end)``."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
