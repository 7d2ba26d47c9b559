"""A draft model: a small causal LM with the target's vocabulary guesses the next tokens.

It runs in the engine's process on its own ``ModelRunner`` (its own paged KV cache, block
manager and prefix cache, the same rules as the target's), on rank 0 alone under tensor
parallelism: a draft is small, and sharding it would add a collective per drafted token for
little compute. Each sequence has a *shadow* in the draft cache; a proposal

1. brings the shadow up to the sequence's tokens: the draft KV it computed stays where its
   tokens are still the sequence's (an accepted draft is), the rest is trimmed, and the
   tokens it lacks run as one chunk;
2. then drafts ``k`` tokens one step at a time, all shadows batched in each step.

The draft draws each token the way the target will verify it: with the sequence's own
sampling parameters, seed and position (greedy when the target is greedy), so the more the two
models agree, the more drafts hold. The draft ignores the grammar (the speculator cuts a draft
at the first token the grammar refuses).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from paged_serve.engine.config import EngineConfig
from paged_serve.engine.model.loader import LoadedModel
from paged_serve.engine.platform.platform import Platform
from paged_serve.engine.runner.build import build_runner, load_for
from paged_serve.engine.runner.model_runner import ModelRunner
from paged_serve.engine.sched.batch import ScheduledBatch, ScheduledRequest
from paged_serve.engine.sched.block_manager import BlockManager
from paged_serve.engine.sched.request import Request
from paged_serve.engine.spec.config import SpeculativeConfig

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Shadow:
    """A sequence in the draft cache: the tokens its KV was computed for (``computed`` of
    ``tokens``)."""

    tokens: list[int]
    computed: int = 0


class DraftModelDrafter:
    """Drafts with ``runner`` over ``block_manager`` (``engine/spec/drafter.py``)."""

    def __init__(self, runner: ModelRunner, block_manager: BlockManager, *, max_model_len: int):
        self.runner = runner
        self.block_manager = block_manager
        self.max_model_len = max_model_len  # the draft model's own positions
        self._shadows: dict[str, _Shadow] = {}

    @classmethod
    def load(
        cls, spec: SpeculativeConfig, config: EngineConfig, target: LoadedModel, platform: Platform
    ) -> DraftModelDrafter:
        """Load ``spec.model`` in the target's dtype on its device; ValueError when its
        vocabulary is not the target's."""
        draft_config = dataclasses.replace(
            config, model=spec.model, speculative_config=None, tensor_parallel_size=1, lora=None
        )
        loaded = load_for(draft_config, platform)
        check_same_vocabulary(target, loaded)
        max_model_len = min(loaded.max_model_len, target.max_model_len)
        runner = build_runner(loaded.model, draft_config, platform, max_model_len=max_model_len)
        bm = BlockManager(
            runner.kv_cache.num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        logger.info("draft model %s: %d KV blocks", loaded.name, bm.num_blocks)
        return cls(runner, bm, max_model_len=max_model_len)

    def propose(self, requests: Sequence[Request], limits: Sequence[int]) -> list[list[int]]:
        drafts: dict[str, list[int]] = {r.request_id: [] for r in requests}
        rows: list[tuple[Request, int]] = []  # (shadow request, its limit)
        for request, limit in zip(requests, limits):
            if request.num_tokens + limit > self.max_model_len:
                continue
            shadow = self._catch_up(request)
            if shadow is not None:
                rows.append((shadow, limit))
        while rows:
            batch = [
                ScheduledRequest(r, r.num_computed_tokens, r.num_tokens - r.num_computed_tokens)
                for r, _ in rows
            ]
            copies = []
            for s in batch:
                copies += self.block_manager.append_slots(s.request.request_id, s.end)
            tables = [self.block_manager.block_table(s.request.request_id) for s in batch]
            result = self.runner.execute(ScheduledBatch(batch, copies), tables)
            kept = []
            for (shadow, limit), s, token in zip(rows, batch, result.token_ids):
                rid = shadow.request_id
                self._computed(rid, shadow, s.end)
                draft = drafts[rid]
                if token < 0:  # no usable logit in the draft's row: draft no further
                    continue
                draft.append(token)
                shadow.output_token_ids.append(token)
                if len(draft) < limit and self.block_manager.can_append(rid, shadow.num_tokens):
                    kept.append((shadow, limit))
            rows = kept
        return [drafts[r.request_id] for r in requests]

    def _catch_up(self, request: Request) -> Request | None:
        """The request's shadow, its draft KV trimmed to what still holds and room for its
        missing tokens; None when the draft pool is short (the request drafts nothing)."""
        bm = self.block_manager
        rid = request.request_id
        tokens = request.all_token_ids
        state = self._shadows.get(rid)
        if state is None or not bm.has(rid):
            # The target's salt keys the draft's cache too: its hits would time a prompt as well.
            cached = bm.cached_prefix(tokens, request.cache_salt)
            if not bm.can_allocate(len(tokens), cached):
                return None
            bm.allocate(rid, len(cached) * bm.block_size, cached, request.cache_salt)
            state = self._shadows[rid] = _Shadow(tokens, len(cached) * bm.block_size)
        else:
            valid = 0
            limit = min(state.computed, len(tokens) - 1)
            while valid < limit and state.tokens[valid] == tokens[valid]:
                valid += 1
            bm.trim(rid, valid)
            state.tokens, state.computed = tokens, valid
            # Only KV the target confirmed is keyed: a rejected draft's never reaches the cache.
            bm.commit(rid, tokens, valid)
        if not bm.can_append(rid, len(tokens)):
            return None
        return dataclasses.replace(
            request,
            output_token_ids=list(request.output_token_ids),
            num_computed_tokens=state.computed,
            matcher=None,
            deferred_matcher=None,
            pending_forks=[],
            prompt_logprobs=None,
        )

    def _computed(self, rid: str, shadow: Request, end: int) -> None:
        """Record that the draft cache now holds ``shadow``'s first ``end`` tokens."""
        shadow.num_computed_tokens = end
        state = self._shadows[rid]
        state.tokens, state.computed = shadow.all_token_ids, end

    def release(self, request_id: str) -> None:
        self._shadows.pop(request_id, None)
        self.block_manager.free(request_id)


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """Raise ValueError unless the draft model speaks the target's token ids."""
    sizes = tuple(int(m.model.config.get_text_config().vocab_size) for m in (target, draft))
    if sizes[0] != sizes[1]:
        raise ValueError(
            f"the draft model's vocabulary ({sizes[1]} tokens) is not the target's ({sizes[0]})"
        )
    t, d = target.tokenizer, draft.tokenizer
    if t is not None and d is not None and t.get_vocab() != d.get_vocab():
        raise ValueError("the draft model's tokenizer is not the target's")
