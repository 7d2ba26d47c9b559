"""Admission: a prompt as token ids, and the checks that refuse a request that could never run
(before it is queued, so a bad request raises in its caller and costs the engine nothing)."""

from __future__ import annotations

from collections.abc import Sequence

from paged_serve.engine.errors import InvalidRequestError
from paged_serve.engine.pooling_params import PoolingParams
from paged_serve.engine.sampling_params import SamplingParams
from paged_serve.engine.sched.block_manager import BlockManager


def prompt_token_ids(
    prompt: str | Sequence[int], tokenizer: object | None, vocab_size: int
) -> list[int]:
    """Token ids of a text prompt (with the tokenizer's special tokens) or a checked id list."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token ids")
        return list(tokenizer(prompt).input_ids)
    ids = list(prompt)
    if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
        raise ValueError("a token-id prompt must be a list of integers")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return ids


def check_request(
    prompt_token_ids: list[int],
    params: SamplingParams,
    *,
    max_num_seqs: int,
    max_model_len: int,
    vocab_size: int,
    block_manager: BlockManager,
) -> None:
    """Raise ValueError (InvalidRequestError naming the field where it is not the prompt) if
    the request can never run: more samples than run at once, an empty prompt, longer than the
    context (tokens), a logit bias outside the vocabulary, more KV blocks than the pool holds."""
    n = len(prompt_token_ids)
    if params.n > max_num_seqs:
        raise InvalidRequestError(
            f"n ({params.n}) is more than this engine runs at once (max_num_seqs "
            f"{max_num_seqs}): a request's samples run together",
            "n",
        )
    if n == 0:
        raise ValueError("the prompt is empty")
    if n >= max_model_len:
        raise ValueError(
            f"the prompt has {n} tokens; this model's context is {max_model_len} tokens"
        )
    if n + params.max_tokens > max_model_len:
        raise ValueError(
            f"prompt ({n} tokens) plus max_tokens ({params.max_tokens}) exceeds the context "
            f"length of {max_model_len} tokens"
        )
    bad = [t for t, _ in params.logit_bias if t >= vocab_size]
    if bad:
        raise ValueError(f"logit_bias token {bad[0]} is outside the vocabulary [0, {vocab_size})")
    need = block_manager.blocks_for(n + params.max_tokens)
    if need > block_manager.num_blocks:
        raise ValueError(
            f"prompt ({n} tokens) plus max_tokens ({params.max_tokens}) needs {need} KV blocks;"
            f" the cache has {block_manager.num_blocks}"
        )


def check_pooling_request(
    prompt_token_ids: list[int],
    params: PoolingParams,
    *,
    max_model_len: int,
    block_manager: BlockManager,
) -> None:
    """Raise ValueError if a pooling request can never run: an empty prompt, longer than the
    context (tokens), segment ids that do not match it, more KV blocks than the pool holds."""
    n = len(prompt_token_ids)
    if n == 0:
        raise ValueError("the input is empty")
    if n > max_model_len:
        raise ValueError(
            f"the input has {n} tokens; this model's context is {max_model_len} tokens"
        )
    types = params.token_type_ids
    if types is not None and len(types) != n:
        raise ValueError(f"{len(types)} token type ids for {n} tokens")
    need = block_manager.blocks_for(n)
    if need > block_manager.num_blocks:
        raise ValueError(
            f"the input ({n} tokens) needs {need} KV blocks; the cache has "
            f"{block_manager.num_blocks}"
        )


def check_cache_salt(cache_salt: str | None) -> None:
    """InvalidRequestError naming ``cache_salt`` unless it is None or a non-empty string (an
    empty salt would look like a partition and be none; vLLM refuses it too) without a NUL
    character (the prefix cache marks its adapters' chains with one: ``Request.prefix_chain``)."""
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise InvalidRequestError(
            f"cache_salt must be a non-empty string, got {cache_salt!r}", "cache_salt"
        )
    if cache_salt is not None and "\0" in cache_salt:
        raise InvalidRequestError("cache_salt must not hold a NUL character", "cache_salt")
